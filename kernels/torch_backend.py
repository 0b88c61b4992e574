"""Paged attention in plain torch (CPU and CUDA): gather whole blocks, then SDPA.

Decode on CPU reads the paged cache in place instead (`kernels._paged_attn`, a C extension built
at install: no gather copy, one call per layer for the whole batch); CUDA tensors, and a CPU
without the extension (a loud warning at import), take the gather path below.

Blocks are gathered with `index_select` on the block axis (one contiguous
block_size * kv_heads * head_dim copy per block), not slot by slot. For decode, the query heads
that share a KV head are folded into SDPA's query-length axis:

    q [B, heads, D] -> [B, kv_heads, group, D]    k, v [B, kv_heads, ctx, D]

which avoids expanding K/V per query head (2-8x faster than `enable_gqa` here, fp32 and bf16).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kernels.attention import AttentionBackend, AttentionMetadata, DecodeBatch, PrefillSegment

log = logging.getLogger(__name__)

try:
    from kernels import _paged_attn
except ImportError as e:  # built at install (setup.py); missing without a C compiler
    _paged_attn = None
    log.warning(
        "kernels._paged_attn is not built (%s): CPU decode attention gathers every request's KV "
        "blocks into a copy per layer (2-4x slower attention). Build it with "
        "`python setup.py build_ext --inplace` (needs a C compiler and the Python headers).", e)

NATIVE_DECODE = _paged_attn is not None
# dtypes the in-place kernel reads (fp32 accumulation either way)
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, native_decode: bool = True) -> None:
        """`native_decode=False`: always the gather path (the tests compare the two)."""
        self.native_decode = native_decode and NATIVE_DECODE

    def forward(self, q: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata,
                out: torch.Tensor) -> torch.Tensor:
        if meta.decode is not None and meta.decode.num:
            dec = meta.decode
            if self.native_decode and _in_place(q, layer_cache, dec, out):
                _decode_in_place(q, layer_cache, dec, out)
            else:
                out[: dec.num] = self._decode(q[: dec.num], layer_cache, dec)
        for seg in meta.prefills:
            out[seg.q_start : seg.q_start + seg.q_len] = self._prefill(q, layer_cache, seg)
        return out

    @staticmethod
    def _gather(layer_cache: torch.Tensor, tables: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the blocks in `tables` ([..., nblocks]) -> [..., ctx, kv_heads, head_dim]."""
        kv_heads, head_dim = layer_cache.shape[-2:]
        lead = tables.shape[:-1]
        idx = tables.reshape(-1)
        k = layer_cache[0].index_select(0, idx).view(*lead, -1, kv_heads, head_dim)[..., :ctx, :, :]
        v = layer_cache[1].index_select(0, idx).view(*lead, -1, kv_heads, head_dim)[..., :ctx, :, :]
        return k, v

    def _decode(self, q: torch.Tensor, layer_cache: torch.Tensor, dec: DecodeBatch) -> torch.Tensor:
        kv_heads, head_dim = layer_cache.shape[-2:]
        b = dec.num
        k, v = self._gather(layer_cache, dec.block_tables, dec.max_ctx)  # [B, ctx, KVH, D]
        qg = q.view(b, kv_heads, -1, head_dim)  # heads sharing a KV head are adjacent
        o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=dec.mask)
        return o.reshape(b, -1)

    def _prefill(self, q: torch.Tensor, layer_cache: torch.Tensor, seg: PrefillSegment) -> torch.Tensor:
        k, v = self._gather(layer_cache, seg.block_table, seg.ctx_len)  # [ctx, KVH, D]
        qs = q[seg.q_start : seg.q_start + seg.q_len].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qs, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            attn_mask=seg.mask, is_causal=seg.mask is None, enable_gqa=True,
        )
        return o[0].transpose(0, 1).flatten(1)


def _in_place(q: torch.Tensor, layer_cache: torch.Tensor, dec: DecodeBatch, out: torch.Tensor) -> bool:
    """The native kernel's preconditions: CPU, fp32/bf16 throughout, rows of contiguous heads."""
    heads, head_dim = q.shape[1:]
    return (layer_cache.device.type == "cpu" and q.dtype in _NATIVE_DTYPES
            and q.dtype == layer_cache.dtype == out.dtype and layer_cache.is_contiguous()
            and q.stride(2) == 1 and q.stride(1) == head_dim and out.stride(1) == 1
            and dec.block_tables.dtype == dec.ctx_lens.dtype == torch.int64
            and dec.block_tables.stride(1) == 1 and dec.ctx_lens.is_contiguous())


def _decode_in_place(q: torch.Tensor, layer_cache: torch.Tensor, dec: DecodeBatch, out: torch.Tensor) -> None:
    """out[:num] = attention of the decode queries over their blocks, read where they lie."""
    assert _paged_attn is not None
    heads, head_dim = q.shape[1:]
    _, num_blocks, block_size, kv_heads, _ = layer_cache.shape
    args = (q.data_ptr(), q.stride(0), layer_cache.data_ptr(), dec.block_tables.data_ptr(),
            dec.block_tables.stride(0), dec.ctx_lens.data_ptr(), out.data_ptr(), out.stride(0),
            dec.num, heads, kv_heads, head_dim, num_blocks, block_size,
            q.dtype == torch.bfloat16, head_dim**-0.5, torch.get_num_threads())
    if torch.autograd.profiler._is_profiler_enabled:  # not a torch op: name it for the profiler
        with torch.profiler.record_function("paged_attention_decode"):
            _paged_attn.decode(*args)
    else:
        _paged_attn.decode(*args)
