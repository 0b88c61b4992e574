"""Paged attention in plain torch (CPU and CUDA): gather whole blocks, then SDPA.

Decode on CPU reads the paged cache in place instead (`kernels._paged_attn`, a C extension built
at install: no gather copy, one call per layer for the whole batch); CUDA tensors, and a CPU
without the extension (a loud warning at import), take the gather path below.

Blocks are gathered with `index_select` on the block axis (one contiguous
block_size * kv_heads * head_dim copy per block), not slot by slot. For decode, the query heads
that share a KV head are folded into SDPA's query-length axis:

    q [B, heads, D] -> [B, kv_heads, group, D]    k, v [B, kv_heads, ctx, D]

which avoids expanding K/V per query head (2-8x faster than `enable_gqa` here, fp32 and bf16).

A sliding window (kernels/attention.py) gathers only the blocks some query of the request can
see and masks the rest, once per (step, window) (`AttentionMetadata.window_cache`):

    decode:  each row's blocks from the one holding its first visible token (ctx - W) on;
             mask: key positions in [ctx - W, ctx)
    prefill: the segment's blocks from the one holding its first query's first visible key on;
             mask: banded causal, the query at position p sees keys (p - W, p]

A window wider than every context is no window: the full path runs, bit-identical to window 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

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


class Keys(NamedTuple):
    """What one decode batch or prefill segment gathers for one window: the blocks `tables`
    ([..., blocks]), the first `ctx` of their tokens, and SDPA's bool mask (True = visible;
    None: all visible, or plain causal for a prefill)."""

    tables: torch.Tensor
    ctx: int
    mask: torch.Tensor | None


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, native_decode: bool = True) -> None:
        """`native_decode=False`: always the gather path (the tests compare the two)."""
        self.native_decode = native_decode and NATIVE_DECODE

    def forward(self, q: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata,
                out: torch.Tensor, window: int = 0, scale: float | None = None) -> torch.Tensor:
        if window < 0:
            raise ValueError(f"a sliding window is >= 0 tokens (0 = none), got {window}")
        block_size = layer_cache.shape[2]
        if meta.decode is not None and meta.decode.num:
            dec = meta.decode
            if self.native_decode and _in_place(q, layer_cache, dec, out):
                _decode_in_place(q, layer_cache, dec, out, window, scale)
            else:
                keys = _cached(meta, ("torch.decode", window),
                               lambda: decode_keys(dec, window, block_size))
                out[: dec.num] = self._decode(q[: dec.num], layer_cache, keys, scale)
        for i, seg in enumerate(meta.prefills):
            keys = _cached(meta, ("torch.prefill", i, window),
                           lambda seg=seg: prefill_keys(seg, window, block_size))
            out[seg.q_start : seg.q_start + seg.q_len] = self._prefill(q, layer_cache, seg, keys,
                                                                       scale)
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

    def _decode(self, q: torch.Tensor, layer_cache: torch.Tensor, keys: Keys,
                scale: float | None) -> torch.Tensor:
        kv_heads, head_dim = layer_cache.shape[-2:]
        b = q.shape[0]
        k, v = self._gather(layer_cache, keys.tables, keys.ctx)  # [B, ctx, KVH, D]
        qg = q.view(b, kv_heads, -1, head_dim)  # heads sharing a KV head are adjacent
        o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=keys.mask, scale=scale)
        return o.reshape(b, -1)

    def _prefill(self, q: torch.Tensor, layer_cache: torch.Tensor, seg: PrefillSegment,
                 keys: Keys, scale: float | None) -> torch.Tensor:
        k, v = self._gather(layer_cache, keys.tables, keys.ctx)  # [ctx, KVH, D]
        qs = q[seg.q_start : seg.q_start + seg.q_len].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qs, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            attn_mask=keys.mask, is_causal=keys.mask is None, enable_gqa=True, scale=scale,
        )
        return o[0].transpose(0, 1).flatten(1)


def _cached(meta: AttentionMetadata, key: tuple[object, ...], build: Callable[[], Keys]) -> Keys:
    """The step's `key` entry, built by the first layer that asks."""
    found = meta.window_cache.get(key)
    if found is None:
        found = meta.window_cache[key] = build()
    return found


def decode_keys(dec: DecodeBatch, window: int, block_size: int) -> Keys:
    """The decode batch's blocks and mask under `window`.

    Row i keeps its blocks from the one holding its first visible token `lo_i = ctx_i - W` on
    (the rows left-aligned, padded with the row's last entries, masked):

        | skipped blocks | lo_i % bs masked, then visible ... ctx_i | padding, masked |
    """
    ctx = dec.ctx_lens
    if window == 0 or dec.max_ctx <= window:
        return Keys(dec.block_tables, dec.max_ctx, dec.mask)
    lo = (ctx - window).clamp_min(0)
    first = lo // block_size  # each row's first block
    blocks = int(((ctx - 1) // block_size - first).max()) + 1
    cols = (first.unsqueeze(1) + torch.arange(blocks, device=ctx.device)).clamp_max(
        dec.block_tables.shape[1] - 1)
    tables = dec.block_tables.gather(1, cols)
    pos = first.unsqueeze(1) * block_size + torch.arange(blocks * block_size, device=ctx.device)
    mask = (pos < ctx.unsqueeze(1)) & (pos >= lo.unsqueeze(1))
    return Keys(tables, blocks * block_size, mask.view(dec.num, 1, 1, -1))


def prefill_keys(seg: PrefillSegment, window: int, block_size: int) -> Keys:
    """A prefill segment's blocks and mask under `window`: from the block holding the first
    query's first visible key on; the query at position p sees keys (p - W, p]."""
    if window == 0 or seg.ctx_len <= window:
        return Keys(seg.block_table, seg.ctx_len, seg.mask)
    first_q = seg.ctx_len - seg.q_len  # the chunk's first query position
    skip = max(0, first_q - window + 1) // block_size  # blocks no query sees
    device = seg.block_table.device
    keys = torch.arange(skip * block_size, seg.ctx_len, device=device).unsqueeze(0)
    queries = torch.arange(first_q, seg.ctx_len, device=device).unsqueeze(1)
    mask = (keys <= queries) & (keys > queries - window)
    return Keys(seg.block_table[skip:], seg.ctx_len - skip * block_size, mask)


def _in_place(q: torch.Tensor, layer_cache: torch.Tensor, dec: DecodeBatch, out: torch.Tensor) -> bool:
    """The native kernel's preconditions: CPU, fp32/bf16 throughout, rows of contiguous heads."""
    heads, head_dim = q.shape[1:]
    return (layer_cache.device.type == "cpu" and q.dtype in _NATIVE_DTYPES
            and q.dtype == layer_cache.dtype == out.dtype and layer_cache.is_contiguous()
            and q.stride(2) == 1 and q.stride(1) == head_dim and out.stride(1) == 1
            and dec.block_tables.dtype == dec.ctx_lens.dtype == torch.int64
            and dec.block_tables.stride(1) == 1 and dec.ctx_lens.is_contiguous())


def _decode_in_place(q: torch.Tensor, layer_cache: torch.Tensor, dec: DecodeBatch, out: torch.Tensor,
                     window: int = 0, scale: float | None = None) -> None:
    """out[:num] = attention of the decode queries over their blocks (the last `window` tokens
    of each, 0 = all), read where they lie."""
    assert _paged_attn is not None
    heads, head_dim = q.shape[1:]
    _, num_blocks, block_size, kv_heads, _ = layer_cache.shape
    args = (q.data_ptr(), q.stride(0), layer_cache.data_ptr(), dec.block_tables.data_ptr(),
            dec.block_tables.stride(0), dec.ctx_lens.data_ptr(), out.data_ptr(), out.stride(0),
            dec.num, heads, kv_heads, head_dim, num_blocks, block_size,
            q.dtype == torch.bfloat16, head_dim**-0.5 if scale is None else scale,
            torch.get_num_threads(), window)
    if torch.autograd.profiler._is_profiler_enabled:  # not a torch op: name it for the profiler
        with torch.profiler.record_function("paged_attention_decode"):
            _paged_attn.decode(*args)
    else:
        _paged_attn.decode(*args)
