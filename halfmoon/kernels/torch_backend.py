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

Several query rows per decoding request (`DecodeBatch.q_lens`): the native kernel takes the rows
as they are (`q_starts`). The gather path gathers each request's blocks once and pads its rows
to the batch's most, q_max (a padding row repeats the request's last row; its output is
dropped), the group folded in as for one row:

    q [rows, heads, D] -> [B, q_max, kv_heads, group, D] -> [B, kv_heads, q_max * group, D]
    mask [B, 1, q_max * group, keys]: row j of request b sees keys < ctx_b - q_len_b + j + 1
                                      (and >= that - W under a window)

built once per (step, window, group) like the one-row masks. A batch whose requests all have
`static_q` rows (a verification CUDA graph's, engine/cuda_graphs.py) takes q_max from it and
needs no padding: nothing depends on the values of q_lens, so a graph can record the step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import torch
import torch.nn.functional as F

from halfmoon.kernels.attention import AttentionBackend, AttentionMetadata, DecodeBatch, PrefillSegment

log = logging.getLogger(__name__)

try:
    from halfmoon.kernels import _paged_attn
except ImportError as e:  # built at install (setup.py); missing without a C compiler
    _paged_attn = None
    log.warning(
        "halfmoon.kernels._paged_attn is not built (%s): CPU decode attention gathers every request's KV "
        "blocks into a copy per layer (2-4x slower attention). Build it with "
        "`python setup.py build_ext --inplace` (needs a C compiler and the Python headers).", e)

NATIVE_DECODE = _paged_attn is not None
T = TypeVar("T")
# dtypes the in-place kernel reads (fp32 accumulation either way)
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


class Keys(NamedTuple):
    """What one decode batch or prefill segment gathers for one window: the blocks `tables`
    ([..., blocks]), the first `ctx` of their tokens, and SDPA's bool mask (True = visible;
    None: all visible, or plain causal for a prefill)."""

    tables: torch.Tensor
    ctx: int
    mask: torch.Tensor | None


class QueryRows(NamedTuple):
    """A multi-query decode batch's rows padded to `q_max` per request: padded slot b * q_max + j
    reads flat row `pad[b * q_max + j]` (the request's last row past its own); real row r's
    output is padded slot `keep[r]`."""

    pad: torch.Tensor
    keep: torch.Tensor
    q_max: int


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
            rows = dec.num_rows
            if self.native_decode and _in_place(q, layer_cache, dec, out):
                _decode_in_place(q, layer_cache, dec, out, window, scale)
            elif dec.multi_query:
                group = q.shape[1] // layer_cache.shape[-2]
                keys = _cached(meta, ("torch.decode_rows", window, group),
                               lambda: decode_rows_keys(dec, window, block_size, group))
                layout = _cached(meta, ("torch.decode_rows",), lambda: query_rows(dec))
                out[:rows] = self._decode_rows(q[:rows], layer_cache, keys, layout, scale)
            else:
                keys = _cached(meta, ("torch.decode", window),
                               lambda: decode_keys(dec, window, block_size))
                out[:rows] = self._decode(q[:rows], layer_cache, keys, scale)
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

    def _decode_rows(self, q: torch.Tensor, layer_cache: torch.Tensor, keys: Keys,
                     layout: QueryRows, scale: float | None) -> torch.Tensor:
        """Several query rows per request: each request's K/V gathered once, its rows padded
        to q_max and folded with the group into SDPA's query axis (module docstring)."""
        kv_heads, head_dim = layer_cache.shape[-2:]
        b, q_max = keys.tables.shape[0], layout.q_max
        k, v = self._gather(layer_cache, keys.tables, keys.ctx)  # [B, ctx, KVH, D]
        qp = (q.index_select(0, layout.pad).view(b, q_max, kv_heads, -1, head_dim)
              .transpose(1, 2).reshape(b, kv_heads, -1, head_dim))
        o = F.scaled_dot_product_attention(qp, k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=keys.mask, scale=scale)
        o = o.view(b, kv_heads, q_max, -1, head_dim).transpose(1, 2).reshape(b * q_max, -1)
        return o.index_select(0, layout.keep)

    def _prefill(self, q: torch.Tensor, layer_cache: torch.Tensor, seg: PrefillSegment,
                 keys: Keys, scale: float | None) -> torch.Tensor:
        k, v = self._gather(layer_cache, keys.tables, keys.ctx)  # [ctx, KVH, D]
        qs = q[seg.q_start : seg.q_start + seg.q_len].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qs, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            attn_mask=keys.mask, is_causal=keys.mask is None, enable_gqa=True, scale=scale,
        )
        return o[0].transpose(0, 1).flatten(1)


def _cached(meta: AttentionMetadata, key: tuple[object, ...], build: Callable[[], T]) -> T:
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


def query_rows(dec: DecodeBatch) -> QueryRows:
    """The padding of a multi-query decode batch's rows to its most rows per request."""
    assert dec.q_lens is not None and dec.q_starts is not None
    if dec.static_q:  # every request has q_max rows: the flat rows are the padded ones
        same = torch.arange(dec.num_rows, device=dec.q_lens.device)
        return QueryRows(same, same, dec.static_q)
    q_lens, starts = dec.q_lens, dec.q_starts[:-1]
    q_max = int(q_lens.max())
    j = torch.arange(q_max, device=q_lens.device)
    pad = starts.unsqueeze(1) + torch.minimum(j, (q_lens - 1).unsqueeze(1))  # [B, q_max]
    rows = dec.num_rows
    first = torch.repeat_interleave(starts, q_lens, output_size=rows)  # each row's request start
    slot = torch.repeat_interleave(torch.arange(dec.num, device=q_lens.device) * q_max, q_lens,
                                   output_size=rows)
    keep = slot + torch.arange(rows, device=q_lens.device) - first
    return QueryRows(pad.flatten(), keep, q_max)


def decode_rows_keys(dec: DecodeBatch, window: int, block_size: int, group: int) -> Keys:
    """A multi-query decode batch's blocks and mask under `window`, the mask
    [B, 1, q_max * group, keys] (row j of request b repeated for its `group` query heads).

    Request b's row j sees keys [lo, hi), hi = ctx_b - q_len_b + j + 1, lo = hi - W (0 without
    a window); rows past q_len_b see what its last row sees. Blocks as in `decode_keys`, from
    the one holding the request's first row's first visible key on.
    """
    assert dec.q_lens is not None
    ctx, q_lens, device = dec.ctx_lens, dec.q_lens, dec.ctx_lens.device
    q_max = dec.static_q or int(q_lens.max())
    j = torch.minimum(torch.arange(q_max, device=device), (q_lens - 1).unsqueeze(1))
    hi = (ctx - q_lens + 1).unsqueeze(1) + j  # [B, q_max]
    if window == 0 or dec.max_ctx <= window:
        tables, first, width = dec.block_tables, torch.zeros_like(ctx), dec.max_ctx
        lo = torch.zeros_like(hi)
    else:
        lo = (hi - window).clamp_min(0)
        first = lo[:, 0] // block_size  # each request's first block
        blocks = int(((ctx - 1) // block_size - first).max()) + 1
        cols = (first.unsqueeze(1) + torch.arange(blocks, device=device)).clamp_max(
            dec.block_tables.shape[1] - 1)
        tables, width = dec.block_tables.gather(1, cols), blocks * block_size
    pos = (first.unsqueeze(1) * block_size + torch.arange(width, device=device)).unsqueeze(1)
    mask = (pos < hi.unsqueeze(2)) & (pos >= lo.unsqueeze(2))  # [B, q_max, width]
    return Keys(tables, width, mask.repeat_interleave(group, dim=1).unsqueeze(1))


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
            and dec.block_tables.stride(1) == 1 and dec.ctx_lens.is_contiguous()
            and (dec.q_starts is None
                 or (dec.q_starts.dtype == torch.int64 and dec.q_starts.is_contiguous()
                     and dec.q_starts.device.type == "cpu")))


def _decode_in_place(q: torch.Tensor, layer_cache: torch.Tensor, dec: DecodeBatch, out: torch.Tensor,
                     window: int = 0, scale: float | None = None) -> None:
    """out[:num_rows] = attention of the decode rows over their blocks (the last `window`
    tokens each sees, 0 = all), read where they lie."""
    assert _paged_attn is not None
    heads, head_dim = q.shape[1:]
    _, num_blocks, block_size, kv_heads, _ = layer_cache.shape
    args = (q.data_ptr(), q.stride(0), layer_cache.data_ptr(), dec.block_tables.data_ptr(),
            dec.block_tables.stride(0), dec.ctx_lens.data_ptr(), out.data_ptr(), out.stride(0),
            dec.num, heads, kv_heads, head_dim, num_blocks, block_size,
            q.dtype == torch.bfloat16, head_dim**-0.5 if scale is None else scale,
            torch.get_num_threads(), window,
            0 if dec.q_starts is None else dec.q_starts.data_ptr())
    if torch.autograd.profiler._is_profiler_enabled:  # not a torch op: name it for the profiler
        with torch.profiler.record_function("paged_attention_decode"):
            _paged_attn.decode(*args)
    else:
        _paged_attn.decode(*args)
