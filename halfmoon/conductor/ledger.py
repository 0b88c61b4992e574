"""What the Conductor has sent each worker and not yet seen finish: the state admission predicts
from, kept on the event loop with no worker round trip (a worker's own counts arrive once a second
and are stale by then: booking decode from them over-committed its KV).

A prefill worker serves its queue in the order its scheduler admits (engine/scheduler.py): higher
rank first, then earlier deadline, then arrival. `PrefillLedger.plan` lays the queue out on a time
line: the job in progress (the head: it started when the one before it finished, or when it was
sent to an idle worker), then the rest in that order:

    now
     |--[ head: cost - elapsed ]--[ job 2 ]--[ job 3 ]--  ...   ms from now
                 ^ a new job of rank r starts after the head and every job of rank >= r

A cluster's prefill worker packs its queue into steps of several prompts (conductor/
prefill_steps.py): its ledger lays the queue out step by step, the step in progress first.

A decode worker's `DecodeLedger` holds the requests bound to it — still in prefill (joining at
their predicted end of prefill) or decoding (tokens so far) — and the KV blocks reserved for them,
exactly: a reservation is booked here before the worker is asked, so two requests never count
the same free blocks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from halfmoon.conductor.prediction import DecodeJob
from halfmoon.conductor.prefill_steps import PrefillSteps


@dataclass(slots=True)
class PendingPrefill:
    """A request sent to a prefill worker whose prefill has not finished.

    deadline: when its first token is due (monotonic s; inf = no TTFT objective).
    cost_ms: predicted prefill + fetch time (alone).
    chunks: co-located: the engine steps its prefill takes (each stretches the running batch's).
    new_tokens, cached_tokens: prompt tokens it computes and reuses (new 0 = unknown: a batched
        ledger lays it out as a step of `cost_ms` alone).
    fetch_ms: of cost_ms, pulling a prefix from another worker.
    queue_deadline: its place in the worker's queue, as the engine's scheduler orders it (None:
        `deadline`): the decision time + its TTFT objective, so a window's requests are served
        in the order the window decided them (conductor/admission_window.py), not in the order
        they arrived microseconds apart.
    """

    request_id: str
    rank: int
    deadline: float
    cost_ms: float
    sent_at: float
    chunks: int = 0
    seq: int = 0
    new_tokens: int = 0
    cached_tokens: int = 0
    fetch_ms: float = 0.0
    queue_deadline: float | None = None
    done_tokens: int = 0  # batched: of new_tokens, computed by the steps that ended (predicted)

    def order(self) -> tuple[int, float, int]:
        return (-self.rank, self.deadline if self.queue_deadline is None else self.queue_deadline, self.seq)


class Slot(NamedTuple):
    """A pending prefill on the predicted time line (ms from now)."""

    job: PendingPrefill
    start_ms: float
    end_ms: float


@dataclass(slots=True)
class PrefillLedger:
    """The pending prefills of one worker (see the module docstring).

    steps None: the worker serves one prefill at a time, never preempted: the head started when
    it was sent to an idle worker or when the head before it finished; then the next in order.
    steps set (the cluster's prefill workers; `Dispatcher` sets it): the worker packs its queue
    into steps of `steps.budget` tokens (conductor/prefill_steps.py). The step in progress began
    when a job was sent to an idle worker (it alone: the engine steps as soon as work arrives)
    or when one of its jobs finished (then: the queue as it stands); every job sent after it
    began, a window's next decisions too, waits for the steps after it.
    """

    jobs: dict[str, PendingPrefill] = field(default_factory=dict)
    head: str | None = None
    head_started: float = 0.0  # monotonic s: the head's start (batched: the step in progress's)
    steps: PrefillSteps | None = None
    in_step: dict[str, int] = field(default_factory=dict)  # batched: the step in progress: tokens per job
    _seq: Iterator[int] = field(default_factory=itertools.count)

    @property
    def depth(self) -> int:
        return len(self.jobs)

    def use(self, steps: PrefillSteps | None) -> None:
        """How the worker steps (the Dispatcher's, before each decision); jobs queued before
        are laid out from here on as a step in progress since the head started."""
        if steps is self.steps:
            return
        self.steps = steps
        if steps is not None and self.jobs:
            self._start_step(self.head_started if self.head is not None else min(j.sent_at for j in self.jobs.values()))

    def add(self, job: PendingPrefill) -> None:
        job.seq = next(self._seq)
        self.jobs[job.request_id] = job
        if self.head is None:
            self.head, self.head_started = job.request_id, job.sent_at
            if self.steps is not None:
                self.in_step = self._members([job])

    def finish(self, request_id: str, now: float) -> None:
        """The prefill ended (or failed, or was aborted); idempotent."""
        if self.jobs.pop(request_id, None) is None:
            return
        if self.steps is not None:
            if request_id in self.in_step:  # its step ended: the next one takes the queue as it stands
                for rid, take in self.in_step.items():
                    if rid in self.jobs:  # computed its chunk (its own finish may come a moment later)
                        self.jobs[rid].done_tokens += take
                self._start_step(now)
            return
        if request_id != self.head:
            return
        nxt = min(self.jobs.values(), key=PendingPrefill.order, default=None)
        self.head, self.head_started = (nxt.request_id, now) if nxt is not None else (None, 0.0)

    def _start_step(self, at: float) -> None:
        """Batched: a step began at `at` with the jobs the budget takes: the ones begun first,
        then in order (a job computed in full only waits for its finish)."""
        self.in_step = self._members(self._waiting())
        self.head = next(iter(self.in_step), None)
        self.head_started = at if self.in_step else 0.0

    def _members(self, queue: list[PendingPrefill]) -> dict[str, int]:
        """The jobs of `queue` (in service order) one step takes, with their tokens."""
        assert self.steps is not None
        takes = self.steps.pack(self.steps.remaining(j) for j in queue)
        return {j.request_id: take for j, take in zip(queue, takes)}

    def _ordered(self) -> list[PendingPrefill]:
        return sorted(self.jobs.values(), key=PendingPrefill.order)

    def _waiting(self) -> list[PendingPrefill]:
        """Batched: the jobs with tokens left, begun ones first (the engine's running
        prefills), then in order."""
        assert self.steps is not None
        steps = self.steps
        return sorted((j for j in self.jobs.values() if steps.remaining(j) > 0), key=_service_key)

    def plan(self, now: float, extra: PendingPrefill | None = None) -> list[Slot]:
        """The queue in service order with predicted start and end (ms from now); `extra`: a
        job not sent yet, laid out in its place (after the step in progress)."""
        if extra is not None:
            extra.seq = UNSENT
        if self.steps is not None:
            return self._batched_plan(now, extra)
        jobs = self._ordered() + ([extra] if extra is not None else [])
        jobs.sort(key=PendingPrefill.order)
        if self.head is None:
            head, t, slots = None, 0.0, []
        else:
            head = self.jobs[self.head]
            t = max(0.0, head.cost_ms - (now - self.head_started) * 1e3)
            slots = [Slot(head, 0.0, t)]
        for job in jobs:
            if job is not head:
                slots.append(Slot(job, t, t + job.cost_ms))
                t += job.cost_ms
        return slots

    def _batched_plan(self, now: float, extra: PendingPrefill | None) -> list[Slot]:
        assert self.steps is not None
        waiting = self._waiting()
        members, started = self.in_step, self.head_started
        if extra is not None and not members:  # an idle worker: its step begins now
            members, started = self._members([extra]), now
        queue = sorted([*waiting, extra] if extra is not None else waiting, key=_service_key)
        first = [j for j in queue if j.request_id in members]
        rest = [j for j in queue if j.request_id not in members]
        elapsed = (now - started) * 1e3 if first else 0.0
        times = self.steps.lay_out(first, rest, elapsed)
        slots = [Slot(j, *times.get(j.request_id, (0.0, 0.0))) for j in self.jobs.values()]  # computed: 0
        if extra is not None:
            slots.append(Slot(extra, *times[extra.request_id]))
        return sorted(slots, key=lambda s: (s.end_ms, s.start_ms))

    def end_ms(self, job: PendingPrefill, now: float) -> float:
        """Predicted end of prefill of `job`, not sent yet, in its place in the queue."""
        return next(s.end_ms for s in self.plan(now, job) if s.job is job)

    def wait_ms(self, rank: int, now: float, deadline: float = math.inf) -> float:
        """Predicted wait before a new job of `rank` (and `deadline`) starts: the head (never
        preempted; batched: the step in progress) and every other job served before it."""
        if self.steps is not None:
            probe = PendingPrefill("", rank, deadline, 0.0, now, new_tokens=1)
            return next(s.start_ms for s in self.plan(now, probe) if s.job is probe)
        plan = self.plan(now)
        ahead = [s for i, s in enumerate(plan) if i == 0 or s.job.order() < (-rank, deadline, math.inf)]
        return sum(s.end_ms - s.start_ms for s in ahead)

    def pushed_past_deadline(self, job: PendingPrefill, now: float, first_token_ms: float) -> PendingPrefill | None:
        """A queued job that `job` (not sent yet) would push past its deadline, if any: its
        predicted first token is its end of prefill + `first_token_ms`."""
        before = {s.job.request_id: s.end_ms for s in self.plan(now)}
        for slot in self.plan(now, job):
            queued = slot.job
            if queued is job or math.isinf(queued.deadline) or slot.end_ms <= before[queued.request_id]:
                continue
            if now + (slot.end_ms + first_token_ms) / 1e3 > queued.deadline:
                return queued
        return None


UNSENT = 1 << 62  # the seq of a job not sent yet: after every job of its rank and deadline


def _service_key(job: PendingPrefill) -> tuple[bool, tuple[int, float, int]]:
    """Batched: where a job stands in the engine's next step: begun prefills first, then in order."""
    return (job.done_tokens == 0, job.order())


@dataclass(slots=True)
class BoundRequest:
    """A request bound to a decode worker, as admission sees it.

    joins_at: monotonic s when it joins the batch (predicted end of prefill; the real one once
        its first token arrived).
    expected_output: tokens it is expected to generate in all (an estimate; <= max_tokens).
    tbt_slo_ms: its TBT objective (inf = none).
    blocks: KV blocks reserved for it on the worker.
    """

    request_id: str
    prompt_len: int
    expected_output: int
    tbt_slo_ms: float
    joins_at: float
    blocks: int
    generated: int = 0
    choices: int = 1  # sequences it decodes (n > 1: each counts in the batch)

    def job(self, now: float) -> DecodeJob:
        remaining = max(1, self.expected_output - self.generated)
        return DecodeJob(max(0.0, (self.joins_at - now) * 1e3), self.prompt_len + self.generated, remaining,
                         self.tbt_slo_ms, max(0, self.expected_output - 1))


TOKENS_PER_STEP_WINDOW = 32  # request-steps per update of a decode ledger's tokens_per_step
TBT_TAIL = 0.1  # TBT is the mean of a request's longest 10% of gaps


def tbt_tokens_per_step(mean: float, single: float) -> float:
    """What a step's time is divided by to give TBT, from a window's mean tokens per step and
    the share of its steps that emitted one token. A chunk of n tokens counts as n gaps of g / n
    (TBT's rule), so one-token steps make the longest gaps: when their gaps are at least the
    longest tenth of all gaps (single / mean >= 0.1), TBT is a whole step; otherwise the rest of
    the tail comes from the chunks of the fewest tokens, taken as 2 (or the chunks' mean, if
    fewer): the workers report no finer distribution, so the divisor is at most 2, on the safe
    side. No speculation (every step one token): 1."""
    mean, single = max(1.0, mean), min(max(single, 0.0), 1.0)
    share = single / mean / TBT_TAIL  # the tail's fraction made of one-token steps' gaps
    if share >= 1.0:
        return 1.0
    chunk = min(2.0, (mean - single) / (1.0 - single))  # tokens of the tail's multi-token chunks
    return 1.0 / (share + (1.0 - share) / chunk)


@dataclass(slots=True)
class DecodeLedger:
    """The requests bound to one decode worker and the KV blocks booked for them."""

    total_blocks: int = 0
    jobs: dict[str, BoundRequest] = field(default_factory=dict)
    reserved_blocks: int = 0
    # tokens a step emits per request as TBT counts them, measured over the worker's recent
    # steps (> 1 with speculative decoding; `tbt_tokens_per_step`): admission divides a
    # predicted step time by it to predict TBT
    tokens_per_step: float = 1.0
    _seen: tuple[int, int, int] = field(default=(0, 0, 0), repr=False)  # counters at the last update

    def observe_decode(self, entries: int, tokens: int, single: int = 0) -> None:
        """A worker's counters since start (request-steps decoded, tokens they emitted, steps
        that emitted one token). Each window of >= `TOKENS_PER_STEP_WINDOW` new request-steps
        moves `tokens_per_step` halfway to the window's `tbt_tokens_per_step`, so it follows
        the load: a speculating worker emits several tokens a step at low batch and one at high
        batch, where its policy turns speculation off. Counters that went back (a restarted
        worker) start a new window."""
        seen = self._seen
        if entries < seen[0] or tokens < seen[1] or single < seen[2]:
            self._seen = (entries, tokens, single)
            return
        steps = entries - seen[0]
        if steps >= TOKENS_PER_STEP_WINDOW:
            now = tbt_tokens_per_step((tokens - seen[1]) / steps, (single - seen[2]) / steps)
            self.tokens_per_step = 0.5 * (self.tokens_per_step + now)
            self._seen = (entries, tokens, single)

    @property
    def free_blocks(self) -> int:
        """Blocks no request of ours holds (prefix-cache blocks are evictable, so free)."""
        return max(0, self.total_blocks - self.reserved_blocks)

    def book(self, bound: BoundRequest) -> None:
        if bound.request_id in self.jobs:
            raise KeyError(f"request {bound.request_id!r} is already booked here")
        self.jobs[bound.request_id] = bound
        self.reserved_blocks += bound.blocks

    def release(self, request_id: str) -> None:
        """The request ended (finished, failed, cancelled): its blocks are free again; idempotent."""
        bound = self.jobs.pop(request_id, None)
        if bound is not None:
            self.reserved_blocks -= bound.blocks

    def decode_jobs(self, now: float) -> list[DecodeJob]:
        return [b.job(now) for b in self.jobs.values() for _ in range(b.choices)]

    def check_integrity(self) -> None:
        """Booked blocks = the sum of the bookings, within the worker's pool."""
        booked = sum(b.blocks for b in self.jobs.values())
        if booked != self.reserved_blocks or (self.total_blocks and booked > self.total_blocks):
            raise AssertionError(f"decode ledger: {self.reserved_blocks} blocks booked, bookings sum to "
                                 f"{booked}, pool has {self.total_blocks}")
