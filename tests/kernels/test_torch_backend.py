"""Torch paged attention against a dense reference built from the same cache, slot by slot."""

from __future__ import annotations

import pytest
import torch

from kernels.torch_backend import TorchAttentionBackend
from tests.kernels.paged_scene import MIXED, Scene, make_scene, run_backend


def _dense_reference(scene: Scene, cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per query: softmax over its visible keys, in float64, with no paging tricks at all."""
    heads, head_dim = scene.q.shape[1:]
    kv_heads = cache.shape[-2]
    group = heads // kv_heads
    flat = cache.view(2, -1, kv_heads, head_dim).double()
    meta = scene.meta
    spans = []
    if meta.decode is not None:
        for i in range(meta.decode.num):
            ctx = int(meta.decode.ctx_lens[i])
            spans.append((i, 1, meta.decode.block_tables[i], ctx))
    spans += [(s.q_start, s.q_len, s.block_table, s.ctx_len) for s in meta.prefills]
    out = torch.zeros(meta.num_tokens, heads, head_dim, dtype=torch.float64)
    for q_start, q_len, table, ctx in spans:
        slots = (table.unsqueeze(1) * block_size + torch.arange(block_size)).flatten()[:ctx]
        k, v = flat[0][slots], flat[1][slots]  # [ctx, kvh, d]
        for j in range(q_len):
            visible = ctx - q_len + j + 1
            q = scene.q[q_start + j].double()  # [heads, d]
            kk = k[:visible].repeat_interleave(group, dim=1)  # [vis, heads, d]
            vv = v[:visible].repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,khd->hk", q, kk) / head_dim**0.5
            out[q_start + j] = torch.einsum("hk,khd->hd", scores.softmax(-1), vv)
    return out.flatten(1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_decode_and_prefill_match_dense_reference(dtype: torch.dtype, tol: float, seed: int) -> None:
    scene = make_scene(**MIXED, dtype=dtype, seed=seed)
    cache = scene.cache.clone()
    out = run_backend(TorchAttentionBackend(), scene, cache)
    ref = _dense_reference(scene, cache, block_size=cache.shape[2])
    assert not torch.isnan(out).any(), "a row of the output was never written"
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_write_kv_lands_in_the_mapped_slots() -> None:
    scene = make_scene(decode_ctx=[5], prefills=[(3, 4)], seed=3)
    cache = scene.cache.clone()
    TorchAttentionBackend().write_kv(cache, scene.k, scene.v, scene.meta.slot_mapping)
    kv_heads, head_dim = cache.shape[-2:]
    flat = cache.view(2, -1, kv_heads, head_dim)
    assert torch.equal(flat[0][scene.meta.slot_mapping], scene.k)
    assert torch.equal(flat[1][scene.meta.slot_mapping], scene.v)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[scene.meta.slot_mapping] = False
    assert torch.equal(flat[:, untouched], scene.cache.view(2, -1, kv_heads, head_dim)[:, untouched])


def test_decode_batch_of_one_without_mask_and_many_with_padding() -> None:
    for ctx in ([7], [7, 7], [3, 16, 1]):
        scene = make_scene(decode_ctx=ctx, prefills=[], seed=4)
        cache = scene.cache.clone()
        out = run_backend(TorchAttentionBackend(), scene, cache)
        torch.testing.assert_close(out.double(), _dense_reference(scene, cache, cache.shape[2]),
                                   atol=1e-5, rtol=1e-5)
