"""Sliding-window attention and the softmax scale in the torch backend (kernels/torch_backend.py)
and the native decode kernel (kernels/_paged_attn.c), against a naive float64 reference.

The window is HF's `sliding_window_overlay`: the query at position p sees keys (p - W, p], the
last W tokens including its own; W = 0 is full causal attention.
"""

from __future__ import annotations

import pytest
import torch

from halfmoon.kernels.torch_backend import TorchAttentionBackend, decode_keys, prefill_keys
from tests.kernels.paged_scene import MIXED, Scene, make_scene, run_backend

BACKENDS = {"native": lambda: TorchAttentionBackend(),
            "gather": lambda: TorchAttentionBackend(native_decode=False)}
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def reference(scene: Scene, cache: torch.Tensor, window: int = 0,
              scale: float | None = None) -> torch.Tensor:
    """Per query: softmax over the keys of its window, in float64, with no paging tricks."""
    heads, head_dim = scene.q.shape[1:]
    block_size, kv_heads = cache.shape[2], cache.shape[-2]
    flat = cache.view(2, -1, kv_heads, head_dim).double()
    meta = scene.meta
    spans = []
    if meta.decode is not None:
        spans += [(i, 1, meta.decode.block_tables[i], int(meta.decode.ctx_lens[i]))
                  for i in range(meta.decode.num)]
    spans += [(s.q_start, s.q_len, s.block_table, s.ctx_len) for s in meta.prefills]
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.full((meta.num_tokens, heads, head_dim), float("nan"), dtype=torch.float64)
    for q_start, q_len, table, ctx in spans:
        slots = (table.unsqueeze(1) * block_size + torch.arange(block_size)).flatten()[:ctx]
        k = flat[0][slots].repeat_interleave(heads // kv_heads, dim=1)  # [ctx, heads, d]
        v = flat[1][slots].repeat_interleave(heads // kv_heads, dim=1)
        for j in range(q_len):
            p = ctx - q_len + j
            lo = max(0, p - window + 1) if window else 0
            scores = torch.einsum("hd,khd->hk", scene.q[q_start + j].double(), k[lo : p + 1])
            out[q_start + j] = torch.einsum("hk,khd->hd", (scores * scale).softmax(-1),
                                            v[lo : p + 1])
    return out.flatten(1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (4, 2, 64, 16), (8, 1, 256, 16), (6, 3, 64, 5), (12, 2, 64, 4)])
@pytest.mark.parametrize("window", [1, 7, 16, 50])
def test_decode_window_matches_reference(backend: str, dtype: torch.dtype, heads: int,
                                         kv_heads: int, head_dim: int, block_size: int,
                                         window: int) -> None:
    """Contexts shorter than the window, equal to it, spanning several blocks past it; windows
    that are and are not a multiple of the block size; GQA groups 2, 6 and 8."""
    ctx = [1, 5, 16, 17, 40, 100, 33, 50]
    scene = make_scene(decode_ctx=ctx, prefills=[], heads=heads, kv_heads=kv_heads,
                       head_dim=head_dim, block_size=block_size, dtype=dtype, seed=window)
    out = torch.full((len(ctx), heads * head_dim), float("nan"), dtype=dtype)
    cache = scene.cache.clone()
    BACKENDS[backend]().write_kv(cache, scene.k, scene.v, scene.meta.slot_mapping)
    BACKENDS[backend]().forward(scene.q, cache, scene.meta, out, window=window)
    want = reference(scene, cache, window)
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    full = reference(scene, cache)
    assert not torch.allclose(want, full, atol=0.1), "the window must change these rows"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [3, 64, 500])
def test_native_window_equals_gather_window_on_long_contexts(dtype: torch.dtype,
                                                             window: int) -> None:
    ctx = [1, 97, 300, 1000, 17, 64, 513, 1200]
    scene = make_scene(decode_ctx=ctx, prefills=[], heads=8, kv_heads=2, head_dim=64,
                       block_size=16, dtype=dtype, seed=5)
    outs = []
    for backend in BACKENDS.values():
        cache = scene.cache.clone()
        out = torch.empty(len(ctx), 8 * 64, dtype=dtype)
        backend().write_kv(cache, scene.k, scene.v, scene.meta.slot_mapping)
        outs.append(backend().forward(scene.q, cache, scene.meta, out, window=window))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol, rtol=tol)


def test_native_decode_reads_nothing_before_the_window() -> None:
    """Every cached token before a request's window is poisoned with NaN: not one may be read
    (a NaN key makes its score, and then the whole output row, NaN)."""
    ctx, window, block_size = [40, 9, 23, 64], 10, 4
    scene = make_scene(decode_ctx=ctx, prefills=[], block_size=block_size, seed=11)
    cache = scene.cache.clone()
    backend = TorchAttentionBackend()
    backend.write_kv(cache, scene.k, scene.v, scene.meta.slot_mapping)
    want = reference(scene, cache, window)
    flat = cache.view(2, -1, *cache.shape[-2:])
    for i, n in enumerate(ctx):
        table = scene.meta.decode.block_tables[i]
        slots = (table.unsqueeze(1) * block_size + torch.arange(block_size)).flatten()
        flat[:, slots[: max(0, n - window)]] = float("nan")
    out = torch.empty(len(ctx), 4 * 16)
    backend.forward(scene.q, cache, scene.meta, out, window=window)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_gather_decode_skips_the_blocks_before_each_window() -> None:
    ctx, window, block_size = [40, 9, 23, 64], 10, 4
    scene = make_scene(decode_ctx=ctx, prefills=[], block_size=block_size, seed=12)
    dec = scene.meta.decode
    keys = decode_keys(dec, window, block_size)
    # row i's first block holds token ctx_i - W: 30 -> block 7, 0 -> 0, 13 -> 3, 54 -> 13
    firsts = [7, 0, 3, 13]
    for i, first in enumerate(firsts):
        assert int(keys.tables[i, 0]) == int(dec.block_tables[i, first])
    assert keys.ctx == 3 * block_size  # at most 3 blocks hold any row's 10 visible tokens
    assert keys.mask.shape == (4, 1, 1, 3 * block_size)
    assert keys.mask.sum(-1).flatten().tolist() == [10, 9, 10, 10]
    # a window wider than every context is no window: the decode batch's own tables and mask
    assert decode_keys(dec, 64, block_size) == (dec.block_tables, dec.max_ctx, dec.mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 5])
@pytest.mark.parametrize("window", [1, 6, 8, 13])
def test_prefill_banded_mask_matches_reference(dtype: torch.dtype, block_size: int,
                                               window: int) -> None:
    """Chunks from position 0 and after a cached prefix, shorter and longer than the window,
    beside decodes in the same step."""
    scene = make_scene(decode_ctx=[9, 1, 30], prefills=[(0, 20), (13, 9), (30, 1), (5, 30),
                                                        (0, 3)],
                       heads=6, kv_heads=2, head_dim=16, block_size=block_size, dtype=dtype,
                       seed=window)
    cache = scene.cache.clone()
    for backend in BACKENDS.values():
        out = torch.full((scene.meta.num_tokens, 6 * 16), float("nan"), dtype=dtype)
        b = backend()
        b.write_kv(cache, scene.k, scene.v, scene.meta.slot_mapping)
        b.forward(scene.q, cache, scene.meta, out, window=window)
        tol = TOL[dtype]
        torch.testing.assert_close(out.double(), reference(scene, cache, window), atol=tol,
                                   rtol=tol)


def test_prefill_keys_band_and_skipped_blocks() -> None:
    scene = make_scene(decode_ctx=[], prefills=[(13, 9), (0, 3)], block_size=4, seed=1)
    seg = scene.meta.prefills[0]  # queries at positions 13..21, keys 0..21
    keys = prefill_keys(seg, 6, 4)
    # the first query (13) sees keys 8..13: blocks 0 and 1 (keys 0..7) are not gathered
    assert torch.equal(keys.tables, seg.block_table[2:])
    assert keys.ctx == 22 - 8
    expected = torch.tensor([[8 + k in range(p - 5, p + 1) for k in range(14)]
                             for p in range(13, 22)])
    assert torch.equal(keys.mask, expected)
    short = scene.meta.prefills[1]  # 3 tokens in a window of 6: plain causal
    assert prefill_keys(short, 6, 4) == (short.block_table, 3, None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_wider_than_every_context_is_bit_identical_to_none(backend: str) -> None:
    scene = make_scene(**MIXED, seed=2)
    full = run_backend(BACKENDS[backend](), scene, scene.cache.clone())
    cache = scene.cache.clone()
    out = torch.empty_like(full)
    b = BACKENDS[backend]()
    b.write_kv(cache, scene.k, scene.v, scene.meta.slot_mapping)
    b.forward(scene.q, cache, scene.meta, out, window=100)
    assert torch.equal(out, full)


def test_masks_are_built_once_per_step_and_window() -> None:
    scene = make_scene(**MIXED, seed=3)
    cache = scene.cache.clone()
    backend = TorchAttentionBackend(native_decode=False)
    out = torch.empty(scene.meta.num_tokens, 4 * 16)
    backend.forward(scene.q, cache, scene.meta, out, window=3)
    built = dict(scene.meta.window_cache)
    assert set(built) == {("torch.decode", 3)} | {("torch.prefill", i, 3) for i in range(4)}
    first = out.clone()
    backend.forward(scene.q, cache, scene.meta, out, window=3)  # the next layer
    assert all(scene.meta.window_cache[k] is v for k, v in built.items()), "reused, not rebuilt"
    assert torch.equal(out, first)
    backend.forward(scene.q, cache, scene.meta, out, window=5)  # another window: its own
    assert len(scene.meta.window_cache) == 2 * len(built)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [0, 4])
def test_scale_replaces_the_default(backend: str, window: int) -> None:
    """Gemma 3's query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5."""
    scene = make_scene(**MIXED, head_dim=16, seed=6)
    cache = scene.cache.clone()
    b = BACKENDS[backend]()
    b.write_kv(cache, scene.k, scene.v, scene.meta.slot_mapping)
    out = torch.full((scene.meta.num_tokens, 4 * 16), float("nan"))
    b.forward(scene.q, cache, scene.meta, out, window=window, scale=0.5)
    want = reference(scene, cache, window, scale=0.5)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(want, reference(scene, cache, window), atol=1e-2)


def test_negative_window_is_refused() -> None:
    scene = make_scene(decode_ctx=[3], prefills=[])
    with pytest.raises(ValueError, match="sliding window"):
        TorchAttentionBackend().forward(scene.q, scene.cache, scene.meta, torch.empty(1, 64),
                                        window=-1)
