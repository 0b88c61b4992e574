"""Torch paged attention against a dense reference built from the same cache, slot by slot."""

from __future__ import annotations

import pytest
import torch

from halfmoon.kernels import torch_backend
from halfmoon.kernels.torch_backend import TorchAttentionBackend
from tests.kernels.paged_scene import MIXED, Scene, make_scene, run_backend

# The in-place C decode kernel and the gather + SDPA path: both must match the reference.
BACKENDS = {"native": lambda: TorchAttentionBackend(), "gather": lambda: TorchAttentionBackend(native_decode=False)}


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


def test_native_decode_kernel_is_built() -> None:
    assert torch_backend.NATIVE_DECODE, "halfmoon.kernels._paged_attn was not built by `pip install -e .`"
    assert TorchAttentionBackend().native_decode


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_decode_and_prefill_match_dense_reference(backend: str, dtype: torch.dtype, tol: float,
                                                        seed: int) -> None:
    scene = make_scene(**MIXED, dtype=dtype, seed=seed)
    cache = scene.cache.clone()
    out = run_backend(BACKENDS[backend](), scene, cache)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_batch_of_one_without_mask_and_many_with_padding(backend: str) -> None:
    for ctx in ([7], [7, 7], [3, 16, 1]):
        scene = make_scene(decode_ctx=ctx, prefills=[], seed=4)
        cache = scene.cache.clone()
        out = run_backend(BACKENDS[backend](), scene, cache)
        torch.testing.assert_close(out.double(), _dense_reference(scene, cache, cache.shape[2]),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,head_dim,block_size", [(3, 64, 16), (1, 128, 16), (4, 24, 5), (8, 64, 64)])
def test_native_decode_equals_gather_path_on_long_contexts(dtype: torch.dtype, group: int, head_dim: int,
                                                           block_size: int) -> None:
    """Long, ragged contexts (several chunks per block, partial last blocks, a batch big enough to
    run on every thread), the model's GQA grouping and head sizes besides the specialised ones."""
    ctx = [1, 97, 300, 1000, 17, 64, 513, 1200]
    scene = make_scene(decode_ctx=ctx, prefills=[], heads=2 * group, kv_heads=2, head_dim=head_dim,
                       block_size=block_size, dtype=dtype, seed=5)
    native = run_backend(TorchAttentionBackend(), scene, scene.cache.clone())
    gather = run_backend(TorchAttentionBackend(native_decode=False), scene, scene.cache.clone())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(native.float(), gather.float(), atol=tol, rtol=tol)


def test_native_decode_reads_q_rows_with_a_stride() -> None:
    """The model hands attention a view of its fused q|k|v rows: q rows are strided, not packed."""
    scene = make_scene(decode_ctx=[40, 9], prefills=[], heads=4, kv_heads=2, head_dim=16, seed=6)
    wide = torch.randn(2, 8, 16)
    wide[:, :4] = scene.q
    strided = wide[:, :4]
    assert not strided.is_contiguous()
    backend = TorchAttentionBackend()
    out = torch.empty(2, 64)
    cache = scene.cache.clone()
    backend.write_kv(cache, scene.k, scene.v, scene.meta.slot_mapping)
    backend.forward(strided, cache, scene.meta, out)
    expected = run_backend(TorchAttentionBackend(native_decode=False), scene, scene.cache.clone())
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
