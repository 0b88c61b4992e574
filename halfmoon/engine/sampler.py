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
    smallest set holding p of the mass); a row without it takes the CDF in vocabulary order (no
    top-k) or over its k largest (`topk`, not a full sort): a sort of a 49k vocabulary costs more
    than a small model's decode step should spend sampling (n > 1 samples n rows a step). Which
    way a row goes depends on its own parameters only, so a seeded request draws the same token
    whatever shares its batch."""
    temps = torch.tensor([r.params.temperature for r in requests], dtype=torch.float32)
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temps.unsqueeze(1)  # <= 0: no overflow
    vocab = scaled.shape[1]
    groups: dict[str, list[int]] = {"nucleus": [], "top_k": [], "dense": []}
    for i, r in enumerate(requests):
        kind = "nucleus" if r.params.top_p < 1.0 else "top_k" if 0 < r.params.top_k < vocab else "dense"
        groups[kind].append(i)
    ways = {"nucleus": _sample_sorted, "top_k": _sample_top_k, "dense": _sample_dense}
    if len(groups["dense"]) == len(requests):  # the common case: one call, no gathers
        return _sample_dense(scaled, requests)
    out = torch.empty(len(requests), dtype=torch.long)
    for kind, rows in groups.items():
        if rows:
            out[rows] = ways[kind](scaled[rows], [requests[i] for i in rows])
    return out


def _draw(cdf: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Column of each row's CDF its request's uniform falls in (the mass renormalised)."""
    uniforms = torch.cat([torch.rand(1, generator=r.generator) for r in requests]) * cdf[:, -1]
    return torch.searchsorted(cdf, uniforms.unsqueeze(1)).clamp_(max=cdf.shape[1] - 1).squeeze(1)


def _sample_dense(scaled: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """No filter: the whole distribution, in vocabulary order."""
    return _draw(torch.softmax(scaled, dim=-1).cumsum(dim=-1), requests)


def _sample_top_k(scaled: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Top-k alone: the largest max-k of each row (best first), each row cut to its own k."""
    ks = [r.params.top_k for r in requests]
    top, idx = scaled.topk(max(ks), dim=-1)
    beyond = torch.arange(top.shape[1]).unsqueeze(0) >= torch.tensor(ks).unsqueeze(1)
    cdf = torch.softmax(top.masked_fill(beyond, float("-inf")), dim=-1).cumsum(dim=-1)
    return idx.gather(1, _draw(cdf, requests).unsqueeze(1)).squeeze(1)


def _sample_sorted(scaled: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Top-p (and top-k with it): the vocabulary sorted, best first."""
    probs_sorted, idx_sorted = torch.sort(scaled, dim=-1, descending=True)
    probs_sorted = _apply_top_k(probs_sorted, [r.params.top_k for r in requests])
    probs_sorted = torch.softmax(probs_sorted, dim=-1)
    probs_sorted = _apply_top_p(probs_sorted, [r.params.top_p for r in requests])
    return idx_sorted.gather(1, _draw(probs_sorted.cumsum(dim=-1), requests).unsqueeze(1)).squeeze(1)


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
