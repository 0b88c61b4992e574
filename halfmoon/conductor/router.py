"""Routing: Mooncake FAST'25 Algorithm 1 (KVCache-centric scheduling), on plain data.

The caller (the Conductor) looks the prompt's block chain up in the cluster index and describes
each worker as a `PrefillView` / `DecodeView`; nothing here talks to Ray, Redis or a worker.

For each live prefill worker p, with `best_len` the longest prefix held anywhere (at
`best_holder`):

    if best_len / max(p.prefix_len, block_size) > balancing_threshold:   pull the missing blocks
        prefix = best_len;      T_transfer = est_transfer(best_len - p.prefix_len)
    else:                                                                 compute them
        prefix = p.prefix_len;  T_transfer = 0
    TTFT(p) = p.queued_prefill_ms + est_prefill(prompt_len - prefix, prefix) + T_transfer (+ p.adapter_ms)

The prefill worker is the one with the smallest TTFT (ties: shorter queue, then worker id). Pulling
hot blocks to where requests run is how hot prefixes get replicated. The decode worker is, among
live ones with free KV blocks for prompt + max_tokens, the one with the smallest predicted step
time after it joins, est_decode_step(running + 1, context + prompt_len) (ties: more free blocks,
then worker id).

A prefix never covers the prompt's last token: the engine always computes it (to sample the first
token), so usable prefixes stop at the last full block before it:

    | usable prefix (whole blocks) | recomputed (>= 1 token) |
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.errors import OverloadedError, ServiceUnavailableError
from halfmoon.core.blocks import cdiv

DEFAULT_BALANCING_THRESHOLD = 2.0


class NoWorkerAvailableError(ServiceUnavailableError):
    """No live prefill or decode worker at all (UNAVAILABLE: retry with backoff)."""


class NoDecodeCapacityError(OverloadedError):
    """Decode workers are alive but none has room for the request now (RESOURCE_EXHAUSTED:
    capacity, retry after the running requests drain)."""


def _check_non_negative(obj: object) -> None:
    for f in fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not value >= 0:
            raise ValueError(f"{type(obj).__name__}.{f.name} must be >= 0, got {value}")


@dataclass(frozen=True, slots=True)
class PrefillView:
    """A prefill worker as the router sees it.

    prefix_len: tokens of this prompt's chain the worker holds (index match, any of its tiers).
    queued_prefill_ms: sum of the predicted prefill times of the requests queued on it.
    adapter_ms: reading the request's LoRA adapter there first (0: it holds it, or no adapter).
    """

    worker_id: str
    prefix_len: int
    queued_prefill_ms: float
    alive: bool = True
    adapter_ms: float = 0.0

    def __post_init__(self) -> None:
        _check_non_negative(self)


@dataclass(frozen=True, slots=True)
class DecodeView:
    """A decode worker: its running batch, their context tokens in all, its free KV blocks."""

    worker_id: str
    running: int
    context_tokens: int
    free_blocks: int
    alive: bool = True

    def __post_init__(self) -> None:
        _check_non_negative(self)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router needs of a request: its size and the best prefix match in the cluster.

    best_len: tokens of the longest prefix held by any holder; best_holder: that holder (None
    when nobody holds block 0).
    """

    prompt_len: int
    max_tokens: int
    best_len: int = 0
    best_holder: str | None = None

    def __post_init__(self) -> None:
        _check_non_negative(self)
        if self.prompt_len < 1:
            raise ValueError("RouteRequest.prompt_len must be >= 1")
        if self.best_len > 0 and self.best_holder is None:
            raise ValueError(f"RouteRequest.best_len is {self.best_len} but best_holder is None")


class PrefillEstimate(NamedTuple):
    """The predicted TTFT of one prefill candidate and its parts."""

    worker_id: str
    prefix_len: int  # tokens not computed (own cache + fetched)
    fetch_tokens: int  # of which pulled from the best holder
    queue_ms: float
    prefill_ms: float
    transfer_ms: float  # pulling the prefix, and reading the request's LoRA adapter when it must
    ttft_ms: float


class DecodeChoice(NamedTuple):
    worker_id: str
    tbt_ms: float
    free_blocks: int


class RoutePlan(NamedTuple):
    """Where a request goes and what the router predicted for it."""

    prefill_id: str
    decode_id: str
    prefix_len: int  # prompt tokens the prefill worker will not compute
    fetch_from: str | None  # holder to pull `fetch_tokens` from, None = nothing to pull
    fetch_tokens: int
    predicted_ttft_ms: float
    predicted_tbt_ms: float
    per_worker: tuple[PrefillEstimate, ...]  # every live prefill candidate, in input order


@dataclass(frozen=True, slots=True)
class Router:
    """Algorithm 1 over one cost model.

    balancing_threshold: Mooncake's kvcache_balancing_threshold; pull the prefix from the best
        holder when it holds more than this many times what the candidate holds.
    """

    cost: CostModel
    block_size: int = 16
    balancing_threshold: float = DEFAULT_BALANCING_THRESHOLD

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if not (math.isfinite(self.balancing_threshold) and self.balancing_threshold > 0):
            raise ValueError(f"balancing_threshold must be > 0, got {self.balancing_threshold}")

    def route(self, request: RouteRequest, prefill: Sequence[PrefillView],
              decode: Sequence[DecodeView]) -> RoutePlan:
        """Pick the prefill worker with the smallest predicted TTFT and the decode worker with
        the smallest predicted TBT; raises `NoWorkerAvailableError` when either has none."""
        best, candidates = self.choose_prefill(request, prefill)
        chosen = self.choose_decode(request, decode)
        fetch_from = request.best_holder if best.fetch_tokens else None
        return RoutePlan(best.worker_id, chosen.worker_id, best.prefix_len, fetch_from,
                         best.fetch_tokens, best.ttft_ms, chosen.tbt_ms, candidates)

    def choose_prefill(self, request: RouteRequest, prefill: Iterable[PrefillView]
                       ) -> tuple[PrefillEstimate, tuple[PrefillEstimate, ...]]:
        """The best live prefill candidate, and the estimates of all of them."""
        views = list(prefill)
        estimates = tuple(self.estimate_prefill(request, p) for p in views if p.alive)
        if not estimates:
            raise NoWorkerAvailableError(f"no live prefill worker ({len(views)} known, all down)")
        return min(estimates, key=lambda e: (e.ttft_ms, e.queue_ms, e.worker_id)), estimates

    def estimate_prefill(self, request: RouteRequest, p: PrefillView) -> PrefillEstimate:
        """TTFT on `p`: queue + prefill of what is neither cached nor fetched + fetch time."""
        usable = self.usable_prefix(request.prompt_len)
        own, best = min(p.prefix_len, usable), min(request.best_len, usable)
        pull = (best > own and request.best_holder not in (None, p.worker_id)
                and best / max(own, self.block_size) > self.balancing_threshold)
        prefix = best if pull else own
        fetch = best - own if pull else 0
        prefill_ms = self.cost.est_prefill_ms(request.prompt_len - prefix, prefix)
        transfer_ms = self.cost.est_transfer_ms(fetch) + p.adapter_ms
        ttft = p.queued_prefill_ms + prefill_ms + transfer_ms
        return PrefillEstimate(p.worker_id, prefix, fetch, p.queued_prefill_ms, prefill_ms,
                               transfer_ms, ttft)

    def choose_decode(self, request: RouteRequest, decode: Iterable[DecodeView]) -> DecodeChoice:
        """Among live decode workers with room for prompt + max_tokens, the smallest predicted
        TBT (ties: more free blocks, then worker id)."""
        views = list(decode)
        live = [d for d in views if d.alive]
        need = self.blocks_needed(request)
        fits = [d for d in live if d.free_blocks >= need]
        if not live:
            raise NoWorkerAvailableError(f"no live decode worker ({len(views)} known, all down)")
        if not fits:
            most = max((d.free_blocks for d in live), default=0)
            raise NoDecodeCapacityError(
                f"no live decode worker has {need} free KV blocks for {request.prompt_len} prompt "
                f"+ {request.max_tokens} output tokens ({len(live)} live, most free: {most})", retry_after_s=1.0,
                reason="kv_capacity")
        choices = [DecodeChoice(d.worker_id, self.predict_tbt_ms(request, d), d.free_blocks)
                   for d in fits]
        return min(choices, key=lambda c: (c.tbt_ms, -c.free_blocks, c.worker_id))

    def predict_tbt_ms(self, request: RouteRequest, d: DecodeView) -> float:
        """Decode step time on `d` once the request has joined its batch."""
        return self.cost.est_decode_step_ms(d.running + 1, d.context_tokens + request.prompt_len)

    def usable_prefix(self, prompt_len: int) -> int:
        """Longest prefix a worker can reuse: whole blocks, never the prompt's last token."""
        return (prompt_len - 1) // self.block_size * self.block_size

    def blocks_needed(self, request: RouteRequest) -> int:
        """KV blocks the decode worker must have free for the whole request."""
        return cdiv(request.prompt_len + request.max_tokens, self.block_size)
