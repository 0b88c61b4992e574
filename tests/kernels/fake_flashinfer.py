"""A stand-in for the flashinfer package (FAKE, named as such): its paged decode / prefill
wrappers computed with torch, logging every plan() with its window and scale, so the backend's
translation and planning are tested on CPU (tests/kernels/test_flashinfer_backend.py,
test_multi_query.py)."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F


def _paged_attention(q: torch.Tensor, paged_kv: tuple[torch.Tensor, torch.Tensor],
                     qo_indptr: list[int], plan: tuple[torch.Tensor, ...], causal: bool,
                     out: torch.Tensor, window_left: int = -1,
                     sm_scale: float | None = None) -> None:
    """FlashInfer's documented semantics: CSR pages, NHD, causal aligned to the end of the keys;
    `window_left` >= 0: the query at (aligned) position p sees keys [p - window_left, p]."""
    indptr, indices, last_page_len = (t.tolist() for t in plan)
    k_cache, v_cache = paged_kv
    page_size = k_cache.shape[1]
    for b in range(len(last_page_len)):
        pages = torch.tensor(indices[indptr[b] : indptr[b + 1]], dtype=torch.long)
        kv_len = (len(pages) - 1) * page_size + last_page_len[b]
        k = k_cache[pages].flatten(0, 1)[:kv_len].transpose(0, 1)
        v = v_cache[pages].flatten(0, 1)[:kv_len].transpose(0, 1)
        qb = q[qo_indptr[b] : qo_indptr[b + 1]].transpose(0, 1)
        mask = None
        if causal:  # tril(diagonal=kv_len - qo_len), as in flashinfer's prefill docstring
            mask = torch.ones(qb.shape[1], kv_len, dtype=torch.bool).tril(kv_len - qb.shape[1])
        if window_left >= 0:
            pos = torch.arange(kv_len - qb.shape[1], kv_len).unsqueeze(1)
            left = torch.arange(kv_len).unsqueeze(0) >= pos - window_left
            mask = left if mask is None else mask & left
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, enable_gqa=True,
                                           scale=sm_scale)
        out[qo_indptr[b] : qo_indptr[b + 1]] = o.transpose(0, 1)


class _FakeDecode:
    def __init__(self, log: list[str], params: list[tuple[str, int, float | None]],
                 workspace: torch.Tensor, kv_layout: str, **_: Any) -> None:
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.log, self.params = log, params

    def _planned(self, kind: str, kw: dict[str, Any]) -> None:
        assert {"q_data_type", "kv_data_type", "window_left", "sm_scale"} <= kw.keys()
        self.log.append(kind)
        self.params.append((kind, kw["window_left"], kw["sm_scale"]))
        self.window_left, self.sm_scale = kw["window_left"], kw["sm_scale"]

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             heads: int, kv_heads: int, head_dim: int, page_size: int, **kw: Any) -> None:
        assert indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32
        self._planned("decode", kw)
        self.tables = (indptr, indices, last_page_len)

    def run(self, q: torch.Tensor, paged_kv: tuple[torch.Tensor, torch.Tensor], *,
            out: torch.Tensor) -> torch.Tensor:
        _paged_attention(q, paged_kv, list(range(q.shape[0] + 1)), self.tables, False, out,
                         self.window_left, self.sm_scale)
        return out


class _FakePrefill(_FakeDecode):
    def plan(self, qo_indptr: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
             last_page_len: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
             page_size: int, *, causal: bool, **kw: Any) -> None:
        assert qo_indptr.dtype == torch.int32
        self._planned("prefill", kw)
        self.qo_indptr, self.causal, self.tables = qo_indptr.tolist(), causal, (
            indptr, indices, last_page_len)

    def run(self, q: torch.Tensor, paged_kv: tuple[torch.Tensor, torch.Tensor], *,
            out: torch.Tensor) -> torch.Tensor:
        assert q.shape[0] == self.qo_indptr[-1]
        _paged_attention(q, paged_kv, self.qo_indptr, self.tables, self.causal, out,
                         self.window_left, self.sm_scale)
        return out


def fake_flashinfer() -> SimpleNamespace:
    log: list[str] = []
    params: list[tuple[str, int, float | None]] = []  # (kind, window_left, sm_scale) per plan
    return SimpleNamespace(
        plan_log=log,
        plan_params=params,
        BatchDecodeWithPagedKVCacheWrapper=functools.partial(_FakeDecode, log, params),
        BatchPrefillWithPagedKVCacheWrapper=functools.partial(_FakePrefill, log, params),
    )
