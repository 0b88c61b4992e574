"""The fused decode calls (kernels/fused.py) against the torch ops they replace.

RoPE, the KV write, the attention output and the residual adds must be bit-identical to the
torch composition; the norm and SiLU (own reduction order and e^x) within a few fp32 ulp, or one
bf16 ulp.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine.model import apply_rope, rope_tables
from kernels import _fused, fused
from kernels.torch_backend import TorchAttentionBackend
from tests.kernels.paged_scene import make_scene

# (atol, rtol): fp32 a few ulp of values ~1-10; bf16 one ulp (2^-8 relative) of the output
TOL = {torch.float32: (1e-5, 2e-6), torch.bfloat16: (1e-6, 2**-7)}


def tables(head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's RoPE cos / signed sin tables for 128 positions."""
    cfg = SimpleNamespace(rope_theta=10000.0, head_dim=head_dim, max_position=128)
    return rope_tables(cfg, dtype)  # type: ignore[arg-type]


def test_fused_kernels_are_built() -> None:
    assert fused.AVAILABLE, "kernels._fused / _paged_attn were not built by `pip install -e .`"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 32])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_torch(dtype: torch.dtype, rows: int, with_delta: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    n = 576
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    # delta is a strided view (every other row of a wider tensor), as an output slice could be
    delta = torch.randn(rows, 2 * n, generator=g).to(dtype)[:, :n]
    w = (torch.randn(n, generator=g) * 0.3 + 1).to(dtype)
    want_x = x + delta if with_delta else x.clone()
    want = F.rms_norm(want_x, (n,), w, 1e-5)
    h = torch.full_like(x, float("nan"))
    _fused.add_rms_norm(x.data_ptr(), n, delta.data_ptr() if with_delta else 0, delta.stride(0),
                        w.data_ptr(), h.data_ptr(), n, rows, n, dtype == torch.bfloat16, 1e-5)
    assert torch.equal(x, want_x), "the residual add must round exactly as torch's x += delta"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(h, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_silu_mul_matches_torch(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    n = 1536
    gate_up = (torch.randn(rows, 2 * n, generator=g) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # e^x clamped at both ends
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate.clone()) * up
    out = torch.full((rows, n), float("nan"), dtype=dtype)
    _fused.silu_mul(gate_up.data_ptr(), 2 * n, out.data_ptr(), n, rows, n, dtype == torch.bfloat16)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode_ctx", [[1], [9, 1, 4, 13], [40, 3, 17, 64, 2, 33]])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (9, 3, 64)])
def test_decode_rope_equals_rope_write_kv_then_attention(
        dtype: torch.dtype, decode_ctx: list[int], heads: int, kv_heads: int,
        head_dim: int) -> None:
    """Ragged all-decode batches: the rotated q, the cache after the write and the attention
    output are bit-identical to apply_rope + write_kv + the native decode kernel."""
    scene = make_scene(decode_ctx=decode_ctx, prefills=[], heads=heads, kv_heads=kv_heads,
                       head_dim=head_dim, dtype=dtype)
    meta, t = scene.meta, len(decode_ctx)
    cos, sin = tables(head_dim, dtype)
    positions = torch.tensor(decode_ctx) - 1
    qkv = torch.cat([scene.q, scene.k, scene.v], dim=1).flatten(1)  # [T, (heads + 2 kv) * hd]

    want_cache = scene.cache.clone()
    want_out = torch.full((t, heads * head_dim), float("nan"), dtype=dtype)
    rows = qkv.view(t, heads + 2 * kv_heads, head_dim)
    qk = apply_rope(rows[:, : heads + kv_heads], cos[positions].unsqueeze(1),
                    sin[positions].unsqueeze(1))
    backend = TorchAttentionBackend()
    backend.write_kv(want_cache, qk[:, heads:], rows[:, heads + kv_heads :], meta.slot_mapping)
    backend.forward(qk[:, :heads], want_cache, meta, want_out)

    cache = scene.cache.clone().unsqueeze(0)  # one layer
    x = torch.zeros(t, 8, dtype=dtype)
    step = fused.DecodeStep(x, positions, (cos, sin), cache, meta, heads, 1e-5)
    got_qkv = qkv.clone()
    out = step.attend(0, got_qkv)
    assert torch.equal(got_qkv.view(t, -1, head_dim)[:, :heads], qk[:, :heads]), "q, in place"
    assert torch.equal(cache[0], want_cache), "K rotated and V copied to their slots, nothing else"
    assert torch.equal(out, want_out)


def test_decode_step_rejects_rows_of_another_dtype_or_shape() -> None:
    scene = make_scene(decode_ctx=[3, 5], prefills=[])
    step = fused.DecodeStep(torch.zeros(2, 8), torch.tensor([2, 4]), tables(16, torch.float32),
                            scene.cache.unsqueeze(0), scene.meta, 4, 1e-5)
    with pytest.raises(ValueError, match="expected"):
        step.attend(0, torch.zeros(2, 8 * 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="expected"):
        step.silu_mul(torch.zeros(3, 10))


@pytest.mark.parametrize("rows", [1, 8])  # 8 x 1536: past NATIVE_ACT_MAX_ELEMENTS, torch's ops
def test_decode_step_silu_mul_for_few_and_many_rows(rows: int) -> None:
    scene = make_scene(decode_ctx=[2] * rows, prefills=[])
    step = fused.DecodeStep(torch.zeros(rows, 8), torch.ones(rows, dtype=torch.long),
                            tables(16, torch.float32),
                            scene.cache.unsqueeze(0), scene.meta, 4, 1e-5)
    gate_up = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(0))
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    torch.testing.assert_close(step.silu_mul(gate_up), want, atol=1e-5, rtol=2e-6)


def test_norm_weights_of_another_dtype_or_layout_turn_the_native_step_off() -> None:
    ones = torch.ones(8)
    assert fused.weights_supported([ones, ones], torch.float32)
    assert not fused.weights_supported([ones, ones.bfloat16()], torch.float32)
    assert not fused.weights_supported([torch.ones(8, 2)[:, 0]], torch.float32)  # strided
    assert not fused.weights_supported([ones.half()], torch.float16)
