"""The decode load a request will meet: Mooncake's prediction-based early rejection (FAST'25,
arXiv version section 7), on plain data.

The load that matters is not the load now but the load when the request reaches the decode
worker — after its prefill — and for as long as it decodes there. Requests decoding now may have
left by then; requests still in prefill will have joined. Each `DecodeJob` is in the batch over

    [joins_at, joins_at + remaining * step)       step = the step time of the batch decoding now

and grows one token per step. `peak` looks at every moment the new request's batch grows (its own
arrival, then each later join while it still decodes) and returns the worst step time, with the
tightest TBT objective of the requests in that batch: admitting a request must keep every member
of every batch it joins within its objective, not only itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from halfmoon.conductor.cost_model import CostModel


@dataclass(frozen=True, slots=True)
class DecodeJob:
    """A request bound to a decode worker, as the load predictor sees it (times: ms from now).

    joins_at_ms: 0 for a request decoding now; its predicted end of prefill for one still in
        prefill.
    context_tokens: its context when it joins (prompt + tokens generated so far).
    remaining_tokens: tokens it still decodes (an estimate, at most max_tokens - generated).
    tbt_slo_ms: its TBT objective (inf = none).
    gaps: its token gaps in all (expected output - 1; 0 = unknown): Mooncake's TBT is the mean
        of the longest tenth of them.
    """

    joins_at_ms: float
    context_tokens: int
    remaining_tokens: int
    tbt_slo_ms: float = math.inf
    gaps: int = 0

    def __post_init__(self) -> None:
        for name in ("joins_at_ms", "context_tokens", "remaining_tokens", "tbt_slo_ms", "gaps"):
            value = getattr(self, name)
            if not value >= 0:  # NaN too
                raise ValueError(f"DecodeJob.{name} must be >= 0, got {value}")

    @property
    def top_gaps(self) -> int:
        """How many gaps its TBT averages (at least one)."""
        return max(1, self.gaps // 10)

    def leaves_at_ms(self, step_ms: float) -> float:
        return self.joins_at_ms + self.remaining_tokens * step_ms


class DecodeLoad(NamedTuple):
    """The predicted decode batch at one moment, the new request included.

    tbt_ms: the step time the cost model gives that batch.
    limit_ms: the tightest TBT objective in it (inf = none).
    """

    batch: int
    context_tokens: int
    tbt_ms: float
    limit_ms: float = math.inf
    at_ms: float = 0.0

    @property
    def slack_ms(self) -> float:
        return self.limit_ms - self.tbt_ms


@dataclass(frozen=True, slots=True)
class DecodeLoadPredictor:
    """The decode load at a future moment, from the requests bound to a worker (see above)."""

    cost: CostModel

    def step_ms_now(self, jobs: Sequence[DecodeJob]) -> float:
        """Step time of the batch decoding now (at least one request, so never zero)."""
        now = [j for j in jobs if j.joins_at_ms <= 0]
        return self.cost.est_decode_step_ms(max(1, len(now)), sum(j.context_tokens for j in now))

    def predict(self, jobs: Sequence[DecodeJob], arrival_ms: float, prompt_len: int,
                tbt_slo_ms: float = math.inf) -> DecodeLoad:
        """The batch at `arrival_ms` (the request's predicted TTFT) with the request in it."""
        return self._load_at(jobs, arrival_ms, self.step_ms_now(jobs), arrival_ms, prompt_len, tbt_slo_ms)

    def peak(self, jobs: Sequence[DecodeJob], arrival_ms: float, prompt_len: int, output_tokens: int,
             tbt_slo_ms: float = math.inf, choices: int = 1) -> DecodeLoad:
        """The moment of the request's stay (arrival .. arrival + output_tokens steps) where its
        batch is closest to (or furthest past) the tightest objective in it; with no objective
        anywhere, the slowest step. `choices`: the sequences it decodes (n > 1)."""
        step = self.step_ms_now(jobs)
        leaves = arrival_ms + output_tokens * step
        moments = [arrival_ms] + sorted(j.joins_at_ms for j in jobs if arrival_ms < j.joins_at_ms < leaves)
        loads = [self._load_at(jobs, t, step, arrival_ms, prompt_len, tbt_slo_ms, choices) for t in moments]
        return min(loads, key=lambda load: (load.slack_ms, -load.tbt_ms))

    def _load_at(self, jobs: Sequence[DecodeJob], t: float, step: float, arrival_ms: float,
                 prompt_len: int, tbt_slo_ms: float, choices: int = 1) -> DecodeLoad:
        own_done = int((t - arrival_ms) / step) if step > 0 else 0
        batch, context, limit = choices, choices * (prompt_len + own_done), tbt_slo_ms
        for job in jobs:
            if job.joins_at_ms <= t < job.leaves_at_ms(step):
                done = int((t - job.joins_at_ms) / step) if step > 0 else 0
                batch += 1
                context += job.context_tokens + min(done, job.remaining_tokens)
                limit = min(limit, job.tbt_slo_ms)
        return DecodeLoad(batch, context, self.cost.est_decode_step_ms(batch, context), limit, t)
