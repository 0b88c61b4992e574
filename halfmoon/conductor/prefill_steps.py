"""How a prefill worker's engine packs its queue into steps, for the Conductor and the simulator.

The engine's scheduler (engine/scheduler.py) fills each step with up to `max_num_batched_tokens`
prompt tokens: the prefills it started and did not finish first, then the waiting ones in queue
order (rank, deadline, arrival), each taking what is left of the budget, the last one a partial
chunk. Every prompt of a step gets its first token at the end of that step, so a burst's
requests finish together, a step later than the first alone would (issue 38: the live 1P1D
cluster's first burst measured 2-3x what one-at-a-time predicted). A step's time is
`CostModel.est_prefill_step_ms` of its chunks.

`pack` is the one packing rule: `PrefillLedger` lays its queue out on it (the Conductor's TTFT
prediction) and the simulated prefill worker steps on it (sim/engines.py).

    step:     | A 112 | B 114 | C 135 | D 151 of 175 |     budget 512: A, B, C first tokens
    next:     | D 24 | E 135 | ...                          D, E ...
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from halfmoon.conductor.cost_model import CostModel


def pack(remaining: Iterable[int], budget: int, max_seqs: int | None = None) -> list[int]:
    """Tokens each prefill computes in one step, in queue order: all it has left while the
    budget lasts, the last one the rest of the budget (a chunk); at most `max_seqs` prompts.
    The list stops where the step does: what follows in `remaining` is not read (a lazy queue
    costs only what fits)."""
    takes, left = [], budget
    for tokens in remaining:
        if left <= 0 or (max_seqs is not None and len(takes) >= max_seqs):
            break
        take = min(tokens, left)
        takes.append(take)
        left -= take
    return takes


def chunked_prefill_ms(cost: CostModel, new: int, cached: int, budget: int) -> float:
    """A prompt's prefill alone on a worker stepping `budget` tokens: the steps of its chunks,
    each after the ones before it (a long prompt pays each step's constant, and its later chunks
    attend to the earlier ones as to a cached prefix)."""
    total, done = 0.0, 0
    while done < new:
        take = min(budget, new - done)
        total += cost.est_prefill_step_ms([(take, cached + done)])
        done += take
    return total


class StepJob(Protocol):
    """A prefill as the layout sees it (conductor/ledger.py's `PendingPrefill`)."""

    request_id: str
    cost_ms: float
    new_tokens: int
    cached_tokens: int
    fetch_ms: float
    done_tokens: int


@dataclass(frozen=True, slots=True)
class PrefillSteps:
    """The prefill engine's step budget (tokens; prompts: its max_num_seqs, None = no limit) and
    the cost model that times its steps."""

    cost: CostModel
    budget: int
    max_seqs: int | None = None

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"a step budget must be >= 1 token, got {self.budget}")

    def demand(self, job: StepJob) -> int:
        """Tokens the job computes; a job of unknown size (new_tokens 0) fills a step alone."""
        return job.new_tokens if job.new_tokens > 0 else self.budget

    def alone_ms(self, new: int, cached: int) -> float:
        """A prefill of `new` tokens after `cached` on an idle worker."""
        return chunked_prefill_ms(self.cost, new, cached, self.budget)

    def pack(self, remaining: Iterable[int]) -> list[int]:
        return pack(remaining, self.budget, self.max_seqs)

    def remaining(self, job: StepJob) -> int:
        return max(0, self.demand(job) - job.done_tokens)

    def step_ms(self, chunks: Sequence[tuple[StepJob, int, int]]) -> float:
        """One step: each `(job, take, done)` computes `take` tokens after `done` of its own; a
        job starting here also pulls its fetched prefix; a job of unknown size costs its
        cost_ms."""
        known = [(take, job.cached_tokens + done) for job, take, done in chunks if job.new_tokens > 0 and take]
        opaque = sum(job.cost_ms for job, take, _ in chunks if job.new_tokens <= 0 and take)
        fetch = sum(job.fetch_ms for job, take, done in chunks if take and done == 0)  # it starts here
        return self.cost.est_prefill_step_ms(known) + opaque + fetch

    def lay_out(self, first: Sequence[StepJob], rest: Sequence[StepJob],
                elapsed_ms: float) -> dict[str, tuple[float, float]]:
        """Each job's (start, end) ms from now: `first` are the step in progress (started
        `elapsed_ms` ago; it ends now at the earliest), then steps of the rest in order, the
        step's unfinished chunks first, as the engine's scheduler runs them."""
        done = {j.request_id: j.done_tokens for j in (*first, *rest)}
        times: dict[str, tuple[float, float]] = {}
        t = 0.0
        queue = list(first)
        pending = list(rest)
        in_progress = True
        while queue or pending:
            if not in_progress:
                queue += pending
                pending = []
            takes = self.pack(self.demand(j) - done[j.request_id] for j in queue)
            takes += [0] * (len(queue) - len(takes))
            chunks = [(j, take, done[j.request_id]) for j, take in zip(queue, takes, strict=True)]
            start = t
            ms = self.step_ms(chunks)
            t = max(0.0, ms - elapsed_ms) if in_progress else t + ms
            kept = []
            for job, take, before in chunks:
                if take and job.request_id not in times:
                    times[job.request_id] = (start, t)
                done[job.request_id] = before + take
                if done[job.request_id] < self.demand(job):
                    kept.append(job)
                else:
                    times[job.request_id] = (times.get(job.request_id, (start, t))[0], t)
            queue = kept
            in_progress = False
        return times
