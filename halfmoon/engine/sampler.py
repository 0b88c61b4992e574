"""Batched sampling: greedy, temperature, top-k, top-p, with a generator per request.

Each sampled row draws exactly one uniform number from its own request's generator per step, so
a seeded request gives the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from halfmoon.engine.request import Request


def sample(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """logits: [B, vocab] fp32, one row per request -> one token id per request."""
    if all(r.params.greedy for r in requests):
        return logits.argmax(dim=-1).tolist()
    tokens = logits.argmax(dim=-1)
    rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    picked = _sample_rows(logits[rows], [requests[i] for i in rows])
    tokens[rows] = picked
    return tokens.tolist()


def _sample_rows(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Inverse-CDF sampling over the temperature-scaled, top-k/top-p filtered distribution, one
    uniform of each request's generator per row. Only top-p needs the vocabulary sorted (the
    smallest set holding p of the mass); without it the CDF is taken in vocabulary order (no
    top-k) or over the k largest (`topk`, not a full sort): a sort of a 49k vocabulary costs
    more than a small model's decode step's sampling should (n > 1 samples n rows a step)."""
    temps = torch.tensor([r.params.temperature for r in requests], dtype=torch.float32)
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temps.unsqueeze(1)  # <= 0: no overflow
    if all(r.params.top_p >= 1.0 for r in requests):
        return _sample_unsorted(scaled, requests)
    probs_sorted, idx_sorted = torch.sort(scaled, dim=-1, descending=True)
    probs_sorted = _apply_top_k(probs_sorted, [r.params.top_k for r in requests])
    probs_sorted = torch.softmax(probs_sorted, dim=-1)
    probs_sorted = _apply_top_p(probs_sorted, [r.params.top_p for r in requests])
    cdf = probs_sorted.cumsum(dim=-1)
    uniforms = torch.cat([torch.rand(1, generator=r.generator) for r in requests])
    uniforms = uniforms * cdf[:, -1]  # the filtered mass is renormalised implicitly
    choice = torch.searchsorted(cdf, uniforms.unsqueeze(1)).clamp_(max=cdf.shape[1] - 1)
    return idx_sorted.gather(1, choice).squeeze(1)


def _sample_unsorted(scaled: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """No top-p: the full distribution in vocabulary order, or (some top-k) the largest
    max-k of each row, each row cut to its own k."""
    ks = [r.params.top_k for r in requests]
    vocab = scaled.shape[1]
    idx = None
    if any(0 < k < vocab for k in ks):
        scaled, idx = scaled.topk(max(k for k in ks if 0 < k < vocab), dim=-1)  # sorted: rank j = column j
        width = scaled.shape[1]
        k = torch.tensor([k if 0 < k < width else width for k in ks]).unsqueeze(1)
        scaled = scaled.masked_fill(torch.arange(width).unsqueeze(0) >= k, float("-inf"))
    cdf = torch.softmax(scaled, dim=-1).cumsum(dim=-1)
    uniforms = torch.cat([torch.rand(1, generator=r.generator) for r in requests]) * cdf[:, -1]
    choice = torch.searchsorted(cdf, uniforms.unsqueeze(1)).clamp_(max=cdf.shape[1] - 1)
    return choice.squeeze(1) if idx is None else idx.gather(1, choice).squeeze(1)


def probabilities(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """The distribution `sample` draws from, dense in vocabulary order: [R, vocab] fp32 (rows of
    a greedy request are one-hot at the argmax). Speculative verification accepts and resamples
    against it (engine/speculative.py)."""
    probs = torch.zeros_like(logits, dtype=torch.float32)
    greedy = [i for i, r in enumerate(requests) if r.params.greedy]
    if greedy:
        probs[greedy, logits[greedy].argmax(dim=-1)] = 1.0
    rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if rows:
        sub = [requests[i] for i in rows]
        temps = torch.tensor([r.params.temperature for r in sub], dtype=torch.float32)
        scaled = (logits[rows] - logits[rows].amax(dim=-1, keepdim=True)) / temps.unsqueeze(1)
        sorted_logits, idx_sorted = torch.sort(scaled, dim=-1, descending=True)
        sorted_probs = torch.softmax(_apply_top_k(sorted_logits, [r.params.top_k for r in sub]), dim=-1)
        sorted_probs = _apply_top_p(sorted_probs, [r.params.top_p for r in sub])
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        probs[rows] = torch.zeros_like(sorted_probs).scatter_(1, idx_sorted, sorted_probs)
    return probs


def _apply_top_k(sorted_logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    if not any(top_ks):
        return sorted_logits
    vocab = sorted_logits.shape[1]
    # k >= vocab keeps every token (off, like 0); clamping also keeps a k over int64 (an HTTP
    # client's JSON integer has no bound) out of the tensor, where it would fail the whole step.
    k = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks]).unsqueeze(1)
    beyond = torch.arange(vocab).unsqueeze(0) >= k
    return sorted_logits.masked_fill(beyond, float("-inf"))


def _apply_top_p(sorted_probs: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    if all(p >= 1.0 for p in top_ps):
        return sorted_probs
    p = torch.tensor(top_ps, dtype=torch.float32).unsqueeze(1)
    # Drop a token when the mass strictly before it already reaches top_p; the first always stays.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    return sorted_probs.masked_fill(mass_before >= p, 0.0)
