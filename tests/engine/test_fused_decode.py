"""The model's native decode step (kernels/fused.py) against its torch step, on a tiny random model.

The native path runs only for all-decode CPU steps with the extensions built; every other step,
and every step without them, takes the torch ops of `DecoderModel._layer`.
"""

from __future__ import annotations

import importlib
import logging
import sys

import pytest
import torch

from halfmoon import kernels
from halfmoon.engine.model import LayerHook, DecoderModel
from halfmoon.engine.model_config import ModelConfig
from halfmoon.kernels import fused
from halfmoon.kernels.attention import AttentionMetadata
from halfmoon.kernels.torch_backend import TorchAttentionBackend
from tests.kernels.paged_scene import MIXED, make_scene

CFG = ModelConfig(architecture="llama", num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=96, vocab_size=50, rope_theta=10000.0,
                  rms_norm_eps=1e-5, max_position=128, tie_word_embeddings=True, bos_id=None,
                  eos_id=0)
BLOCK_SIZE = 4
# token ids, positions, the cache of every layer, metadata, logits rows
StepInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]


def tiny_model(dtype: torch.dtype) -> DecoderModel:
    g = torch.Generator().manual_seed(0)

    def w(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    h, i = CFG.hidden_size, CFG.intermediate_size
    weights = {"model.embed_tokens.weight": w(CFG.vocab_size, h, scale=1.0),
               "model.norm.weight": 1 + w(h)}
    shapes = {"input_layernorm": (h,), "post_attention_layernorm": (h,),
              "self_attn.q_proj": (CFG.q_size, h), "self_attn.k_proj": (CFG.kv_size, h),
              "self_attn.v_proj": (CFG.kv_size, h), "self_attn.o_proj": (h, CFG.q_size),
              "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    for layer in range(CFG.num_layers):
        for name, shape in shapes.items():
            norm = len(shape) == 1
            weights[f"model.layers.{layer}.{name}.weight"] = 1 + w(*shape) if norm else w(*shape)
    return DecoderModel(CFG, weights, TorchAttentionBackend(), dtype)


def step_inputs(decode_ctx: list[int], prefills: list[tuple[int, int]],
                dtype: torch.dtype) -> StepInputs:
    """A step laid out like the runner's, and a random cache of every layer."""
    scene = make_scene(decode_ctx=decode_ctx, prefills=prefills, heads=CFG.num_heads,
                       kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim, block_size=BLOCK_SIZE,
                       dtype=dtype)
    meta = scene.meta
    positions = [c - 1 for c in decode_ctx]
    positions += [p for cached, new in prefills for p in range(cached, cached + new)]
    ids = torch.randint(0, CFG.vocab_size, (meta.num_tokens,),
                        generator=torch.Generator().manual_seed(1))
    cache = torch.stack([scene.cache * (layer + 1) for layer in range(CFG.num_layers)])
    rows = torch.arange(meta.num_tokens)
    return ids, torch.tensor(positions), cache, meta, rows


def run(model: DecoderModel, fused_decode: bool, inputs: StepInputs,
        hook: LayerHook | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and the cache after one forward on a copy of the inputs' cache."""
    ids, positions, cache, meta, rows = inputs
    model.fused_decode = fused_decode
    cache = cache.clone()
    return model.forward(ids, positions, cache, meta, rows, hook), cache


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("decode_ctx", [[1], [9, 1, 4, 13]])
def test_native_decode_step_matches_the_torch_step(dtype: torch.dtype, tol: float,
                                                   decode_ctx: list[int]) -> None:
    model = tiny_model(dtype)
    inputs = step_inputs(decode_ctx, [], dtype)
    want, want_cache = run(model, False, inputs)
    got, got_cache = run(model, True, inputs)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(got_cache.float(), want_cache.float(), atol=tol, rtol=tol)


def test_the_layer_hook_sees_each_layers_kv_written_and_the_next_ones_not() -> None:
    model = tiny_model(torch.float32)
    inputs = step_inputs([9, 1, 4, 13], [], torch.float32)
    _, final = run(model, True, inputs)
    slots = inputs[3].slot_mapping
    before = inputs[2].view(CFG.num_layers, 2, -1, CFG.num_kv_heads, CFG.head_dim)[:, :, slots]
    after = final.view(CFG.num_layers, 2, -1, CFG.num_kv_heads, CFG.head_dim)[:, :, slots]
    seen: list[int] = []
    live: list[torch.Tensor] = []

    def hook(layer: int) -> None:
        now = live[0].view(CFG.num_layers, 2, -1, CFG.num_kv_heads, CFG.head_dim)[:, :, slots]
        assert torch.equal(now[: layer + 1], after[: layer + 1]), f"layer {layer}'s K/V not there"
        assert torch.equal(now[layer + 1 :], before[layer + 1 :]), f"a layer after {layer} written"
        seen.append(layer)

    ids, positions, cache, meta, rows = inputs
    live.append(cache.clone())
    model.fused_decode = True
    model.forward(ids, positions, live[0], meta, rows, hook)
    assert seen == list(range(CFG.num_layers))


def test_mixed_steps_and_a_disabled_model_take_the_torch_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the native decode step ran")

    model = tiny_model(torch.float32)
    monkeypatch.setattr(fused, "DecodeStep", refuse)
    run(model, True, step_inputs(MIXED["decode_ctx"], MIXED["prefills"], torch.float32))
    run(model, True, step_inputs([], [(0, 5)], torch.float32))
    run(model, False, step_inputs([3, 7], [], torch.float32))


def test_without_the_extensions_a_warning_and_the_torch_path(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delattr(kernels, "_fused")
    monkeypatch.setitem(sys.modules, "halfmoon.kernels._fused", None)  # import fails as if never built
    try:
        with caplog.at_level(logging.WARNING, logger="halfmoon.kernels.fused"):
            importlib.reload(fused)
        assert not fused.AVAILABLE
        assert "halfmoon.kernels._fused or kernels._paged_attn is not built" in caplog.text
        model = tiny_model(torch.float32)
        assert not model.fused_decode
        inputs = step_inputs([9, 1, 4, 13], [], torch.float32)
        model.fused_decode = True  # even when asked: supported() says no
        got, _ = run(model, True, inputs)
        want, _ = run(model, False, inputs)
        assert torch.equal(got, want)
    finally:
        monkeypatch.undo()
        importlib.reload(fused)
    assert fused.AVAILABLE
