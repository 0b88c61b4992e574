"""FlashInfer paged attention (CUDA only). flashinfer is imported lazily, in the constructor.

The per-layer cache `[2, blocks, block_size, kv_heads, head_dim]` already is FlashInfer's paged
"NHD" layout: `(layer_cache[0], layer_cache[1])` is its `(k_cache, v_cache)` tuple, one page per
block. Each step the metadata is turned into FlashInfer's CSR page tables once, both wrappers are
planned once, and every layer only calls `run`:

    | decode q (1 per request) -> BatchDecode | prefill chunks (qo_indptr) -> BatchPrefill |

A decode batch with several rows per request (`DecodeBatch.q_lens`, speculative decoding's
verify step) has no BatchDecode: its requests join the prefill chunks in the one BatchPrefill
plan, qo_indptr = q_starts then the chunks' (causal aligned to the end of the keys is exactly
the decode rows' causal rule):

    | decode rows (q_starts) + prefill chunks -> BatchPrefill |

A request with context length `ctx` owns the first `ceil(ctx / block_size)` blocks of its block
table, one page each; the last one holds `ctx - (pages - 1) * block_size` tokens.

A plan fixes the sliding window (`window_left = window - 1`, -1 = none: FlashInfer counts the
keys left of the query's own) and the softmax scale (`sm_scale`), so each distinct
(window, scale) of a step has its own pair of wrappers, planned on the step's first layer with
that pair (Gemma 3: one for the local layers, one for the global ones); the page tables are built
once per step and shared by all plans.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from halfmoon.core.blocks import cdiv
from halfmoon.kernels.attention import AttentionBackend, AttentionMetadata, DecodeBatch, PrefillSegment

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace (split-k partials)


class FlashInferUnavailableError(RuntimeError):
    """flashinfer is not installed or there is no CUDA device."""


class PageTable(NamedTuple):
    """FlashInfer's CSR page table for a batch of requests (int32, on the host)."""

    indptr: torch.Tensor  # [batch + 1]; request b owns indices[indptr[b]:indptr[b + 1]]
    indices: torch.Tensor  # [total pages] block ids, in token order per request
    last_page_len: torch.Tensor  # [batch], each in 1..block_size


def page_table(tables: Sequence[torch.Tensor], ctx_lens: torch.Tensor, block_size: int) -> PageTable:
    """CSR page table of requests with block tables `tables[i]` and context lengths `ctx_lens`.

    Entries past a request's `ceil(ctx / block_size)` pages (decode padding) are ignored.
    """
    ctx = ctx_lens.to("cpu", torch.int64)
    if bool((ctx < 1).any()):
        raise ValueError(f"every request needs at least one key, got lengths {ctx.tolist()}")
    num_pages = cdiv(ctx, block_size)  # elementwise on the int64 tensor
    pages = [t[:n] for t, n in zip(tables, num_pages.tolist(), strict=True)]
    if any(len(p) != n for p, n in zip(pages, num_pages.tolist())):
        raise ValueError("a block table is shorter than its context length needs")
    return PageTable(
        indptr=F.pad(num_pages.cumsum(0), (1, 0)).int(),
        indices=torch.cat(pages).cpu().int(),  # one device-to-host copy per step
        last_page_len=(ctx - (num_pages - 1) * block_size).int(),
    )


def decode_page_table(dec: DecodeBatch, block_size: int) -> PageTable:
    """Page table of the decode batch."""
    return page_table(dec.block_tables.unbind(0), dec.ctx_lens, block_size)


def prefill_page_table(prefills: Sequence[PrefillSegment], block_size: int) -> PageTable:
    ctx = torch.tensor([seg.ctx_len for seg in prefills], dtype=torch.int64)
    return page_table([seg.block_table for seg in prefills], ctx, block_size)


def prefill_qo_indptr(prefills: Sequence[PrefillSegment]) -> torch.Tensor:
    """[segments + 1] query offsets relative to the first chunk; chunks must be back to back."""
    for prev, seg in zip(prefills, prefills[1:]):
        if seg.q_start != prev.q_start + prev.q_len:
            raise ValueError(f"prefill chunks are not contiguous: {prev.q_start}+{prev.q_len} "
                             f"then {seg.q_start}")
    lens = torch.tensor([seg.q_len for seg in prefills], dtype=torch.int64)
    return F.pad(lens.cumsum(0), (1, 0)).int()


def prefill_tables(dec: DecodeBatch | None, prefills: Sequence[PrefillSegment],
                   block_size: int) -> tuple[PageTable, torch.Tensor]:
    """The BatchPrefill page table and qo_indptr of a step whose decode rows (multi-query
    `dec`, or None) go through the prefill wrapper: the decode requests first (qo_indptr =
    q_starts), then the prefill chunks, which must follow the decode rows back to back."""
    if dec is None:
        return prefill_page_table(prefills, block_size), prefill_qo_indptr(prefills)
    assert dec.q_starts is not None
    tables = [seg.block_table for seg in prefills]
    ctx = torch.tensor([seg.ctx_len for seg in prefills], dtype=torch.int64)
    qo = prefill_qo_indptr(prefills) if prefills else torch.zeros(1, dtype=torch.int32)
    rows = dec.num_rows
    if prefills and prefills[0].q_start != rows:
        raise ValueError(f"the first prefill chunk starts at {prefills[0].q_start}, not after "
                         f"the {rows} decode rows")
    starts = dec.q_starts.to("cpu", torch.int32)
    return (page_table([*dec.block_tables.unbind(0), *tables],
                       torch.cat([dec.ctx_lens.to("cpu", torch.int64), ctx]), block_size),
            torch.cat([starts, qo[1:] + rows]))


def _require_flashinfer() -> ModuleType:
    if not torch.cuda.is_available():
        raise FlashInferUnavailableError(
            "the flashinfer attention backend needs a CUDA device and none is visible; "
            "use the 'torch' backend on CPU, or run on a GPU with `pip install 'halfmoon[gpu]'`"
        )
    try:
        import flashinfer  # noqa: PLC0415 — optional extra `halfmoon[gpu]`
    except ImportError as e:
        raise FlashInferUnavailableError(
            "flashinfer is not installed; install it with `pip install 'halfmoon[gpu]'` "
            "or choose the 'torch' attention backend"
        ) from e
    return flashinfer


class StepTables(NamedTuple):
    """A step's page tables, shared by every (window, scale) plan of the step; the prefill
    wrapper runs the flat rows [prefill_start, prefill_end)."""

    decode: PageTable | None
    prefill: PageTable | None
    qo_indptr: torch.Tensor | None
    prefill_start: int = 0
    prefill_end: int = 0


class Wrappers(NamedTuple):
    decode: Any
    prefill: Any


def step_tables(meta: AttentionMetadata, block_size: int) -> StepTables:
    """One step's page tables: one-row decodes through BatchDecode; multi-query decode rows
    and prefill chunks through BatchPrefill."""
    dec = meta.decode if meta.decode is not None and meta.decode.num else None
    if dec is not None and not dec.multi_query:
        decode, dec = decode_page_table(dec, block_size), None
    else:
        decode = None
    if dec is None and not meta.prefills:
        return StepTables(decode, None, None)
    prefill, qo = prefill_tables(dec, meta.prefills, block_size)
    start = 0 if dec is not None else meta.prefills[0].q_start
    return StepTables(decode, prefill, qo, start, start + int(qo[-1]))


class FlashInferAttentionBackend(AttentionBackend):
    """K/V written by slot; attention by FlashInfer's paged decode / prefill wrappers.

    Each (window, scale) pair's wrappers are planned on the first `forward` of a step that uses
    it and reused by every layer with that pair: the runner passes one AttentionMetadata object
    to all layers of a step, so object identity marks the step. The planned meta is held (not
    just its id) so its id cannot be reused.
    """

    name = "flashinfer"
    # What FlashInfer's paged prefill kernels are built for (0.7.2 on an H200: head_dim 16 fails
    # at run time with "Invalid configuration"; decode would build). Checked before planning.
    SUPPORTED_HEAD_DIMS = (64, 128, 256)

    def __init__(self, module: ModuleType | None = None) -> None:
        """`module` stands in for the flashinfer package (tests: no kernel-size limits); by
        default it is imported."""
        self._fi = module if module is not None else _require_flashinfer()
        self._head_dims = self.SUPPORTED_HEAD_DIMS if module is None else None
        self._workspace: torch.Tensor | None = None  # allocated once, on the cache's device
        self._wrappers: dict[tuple[int, float | None], Wrappers] = {}  # by (window, scale)
        self._planned_for: AttentionMetadata | None = None
        self._tables: StepTables | None = None  # the planned step's
        self._planned: set[tuple[int, float | None]] = set()  # of the planned step

    def forward(self, q: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata,
                out: torch.Tensor, window: int = 0, scale: float | None = None) -> torch.Tensor:
        if window < 0:
            raise ValueError(f"a sliding window is >= 0 tokens (0 = none), got {window}")
        if meta is not self._planned_for:
            self._new_step(q, layer_cache, meta)
        key = (window, scale)
        if key not in self._planned:
            self._plan(q, layer_cache, meta, key)
        wrappers = self._wrappers[key]
        q = q.contiguous()
        heads, head_dim = q.shape[1:]
        paged_kv = (layer_cache[0], layer_cache[1])
        tables = self._tables
        assert tables is not None
        if tables.decode is not None:
            n = tables.decode.last_page_len.shape[0]
            wrappers.decode.run(q[:n], paged_kv, out=out[:n].view(n, heads, head_dim))
        if tables.prefill is not None:
            start, end = tables.prefill_start, tables.prefill_end
            wrappers.prefill.run(q[start:end], paged_kv,
                                 out=out[start:end].view(end - start, heads, head_dim))
        return out

    def _new_step(self, q: torch.Tensor, layer_cache: torch.Tensor,
                  meta: AttentionMetadata) -> None:
        """Once per step: the checks, the workspace, the page tables; no plan is valid yet."""
        _, _, block_size, kv_heads, head_dim = layer_cache.shape
        heads = q.shape[1]
        if self._head_dims is not None and head_dim not in self._head_dims:
            raise ValueError(f"the flashinfer backend runs head_dim {list(self._head_dims)}, this model has "
                             f"{head_dim}: use --attention-backend torch")
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads is not a multiple of {kv_heads} kv heads")
        self._ensure_workspace(layer_cache.device)
        self._tables = step_tables(meta, block_size)
        self._planned = set()
        self._planned_for = meta

    def _plan(self, q: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata,
              key: tuple[int, float | None]) -> None:
        """Once per step and (window, scale): plan() on each wrapper the step uses."""
        _, _, block_size, kv_heads, head_dim = layer_cache.shape
        heads = q.shape[1]
        window, scale = key
        wrappers = self._wrappers.get(key)
        if wrappers is None:
            wrappers = self._wrappers[key] = self._make_wrappers(heads // kv_heads)
        assert self._tables is not None
        kw = {"q_data_type": q.dtype, "kv_data_type": layer_cache.dtype,
              "window_left": window - 1 if window else -1, "sm_scale": scale}
        if (pt := self._tables.decode) is not None:
            wrappers.decode.plan(pt.indptr, pt.indices, pt.last_page_len, heads, kv_heads,
                                 head_dim, block_size, **kw)
        if (pt := self._tables.prefill) is not None:
            # causal=True aligns each chunk's queries to the end of its keys, so a chunk after
            # a cached prefix sees the whole prefix: exactly PrefillSegment.mask.
            wrappers.prefill.plan(self._tables.qo_indptr, pt.indptr, pt.indices,
                                  pt.last_page_len, heads, kv_heads, head_dim, block_size,
                                  causal=True, **kw)
        self._planned.add(key)

    def _ensure_workspace(self, device: torch.device) -> None:
        if self._workspace is not None:
            if self._workspace.device != device:
                raise ValueError(f"flashinfer backend was set up on {self._workspace.device}, "
                                 f"got a KV cache on {device}")
            return
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)

    def _make_wrappers(self, group_size: int) -> Wrappers:
        # One float workspace for all wrappers, as vLLM does: their runs never overlap.
        # Tensor-core decode pays off for wide GQA groups (vLLM's threshold).
        return Wrappers(
            self._fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD",
                                                        use_tensor_cores=group_size > 4),
            self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD"))
