"""Dispatch: route, admit and book one request, synchronously, on the Conductor's ledgers.

The one decision path of the cluster backend, the co-located backend and the simulator (`sim/`).
Each hands over its workers' ledgers, what the prefix cache holds and the time; nothing here
awaits, calls a worker or reads a clock of its own, so the simulator runs the production decision
on simulated time:

    cluster     objective -> Router (Mooncake Alg. 1) -> Admission.decide -> book both ledgers
    co-located  objective -> Admission.decide on the engine's two ledgers  -> book both

A rejection raises the admission's error (429 / RESOURCE_EXHAUSTED) and books nothing. An admitted
request is a `Booking`; when it ends, `finished` feeds what it measured back (output-length
estimate, calibration, error histograms) and the caller releases its bookings
(`PrefillLedger.finish`, `DecodeLedger.release`: each idempotent).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from halfmoon.conductor.admission import Admission, AdmissionConfig, Candidate, Decision, Objective, Reason, resolve
from halfmoon.conductor.admission_stats import MIN_SAMPLE_GAPS, AdmissionStats
from halfmoon.conductor.admission_window import SecondLook
from halfmoon.conductor.backend import Slo
from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.errors import OverloadedError
from halfmoon.conductor.ledger import BoundRequest, DecodeLedger, PrefillLedger
from halfmoon.conductor.prefill_steps import PrefillSteps
from halfmoon.conductor.router import DecodeView, PrefillView, RoutePlan, Router, RouteRequest
from halfmoon.core.blocks import cdiv

COLOCATED = "engine"  # the worker id of both sides in co-located mode


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """What the index knows of a prompt: per prefill worker the tokens it can reuse (own device,
    or the node's shared host/disk), and the longest match anywhere with its holder."""

    per_worker: dict[str, int] = field(default_factory=dict)
    best_tokens: int = 0
    best_holder: str = ""
    # per prefill worker: reading the request's LoRA adapter first (absent: it holds it / none)
    adapter_ms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PrefillSide:
    """A prefill worker as dispatch sees it: its id, the Conductor's ledger of it, whether it
    may take requests (alive and not excluded for this request)."""

    worker_id: str
    ledger: PrefillLedger
    alive: bool = True


@dataclass(frozen=True, slots=True)
class DecodeSide:
    worker_id: str
    ledger: DecodeLedger
    alive: bool = True


@dataclass(frozen=True, slots=True)
class Ask:
    """What dispatch needs of a request (the rest stays with the caller)."""

    request_id: str
    prompt_len: int
    max_tokens: int
    priority_class: str | None = None
    slo: Slo = field(default_factory=Slo)
    resumed: bool = False  # a request moving to other workers (conductor/migration.py): admitted once already
    choices: int = 1  # SamplingParams.n: sequences decoded from one prefill


@dataclass(frozen=True, slots=True)
class Booking:
    """An admitted request: where it runs, what admission decided, what it booked."""

    request_id: str
    objective: Objective
    candidate: Candidate
    decision: Decision
    bound: BoundRequest  # its booking in the decode side's ledger
    prefill_id: str
    decode_id: str
    prefix_tokens: int  # prompt tokens the prefill side does not compute (cached or fetched)
    fetch_from: str | None = None  # the worker the router priced pulling a prefix from (None: none)

    @property
    def deadline(self) -> float:
        """Its place in a prefill queue: the decision time + its TTFT objective (inf = none;
        `Candidate.queue_deadline`)."""
        return self.candidate.queue_deadline


class Dispatcher:
    """Router + admission over one cost model (see the module docstring).

    colocated_chunk: prefill and decode share one engine whose steps carry up to this many
        prefill tokens (co-located mode; None in a cluster).
    clock: what the calibration's window is measured on (the simulator passes its own).
    prefill_budget: a cluster's prefill workers pack their queues into steps of this many
        tokens (their engines' max_num_batched_tokens) and at most `prefill_max_seqs` prompts
        (None: no limit): their ledgers lay queues out so (conductor/prefill_steps.py). None: one
        prefill at a time.
    """

    def __init__(self, config: AdmissionConfig, cost: CostModel, block_size: int,
                 colocated_chunk: int | None = None, stats: AdmissionStats | None = None,
                 clock: Callable[[], float] = time.monotonic, prefill_budget: int | None = None,
                 prefill_max_seqs: int | None = None) -> None:
        self.config = config
        self.cost = cost
        self.block_size = block_size
        self.prefill_steps = PrefillSteps(cost, prefill_budget, prefill_max_seqs) if prefill_budget else None
        self.admission = Admission(config, cost, colocated_chunk, clock)
        self.router = Router(cost, block_size)
        self.stats = stats if stats is not None else AdmissionStats()

    def objective(self, ask: Ask) -> Objective:
        return resolve(self.config, ask.priority_class, ask.slo)

    # ------------------------------------------------------------------ cluster

    def window_key(self, ask: Ask, prefix: PrefixMatch) -> tuple[int, float]:
        """Its rank and predicted prefill (at the best prefix anywhere): its place in the
        admission window (conductor/admission_window.py)."""
        cached = max(0, min(prefix.best_tokens, ask.prompt_len - 1))
        return self.objective(ask).rank, self.cost.est_prefill_ms(ask.prompt_len - cached, cached)

    def dispatch(self, ask: Ask, prefix: PrefixMatch, prefill: Sequence[PrefillSide],
                 decode: Sequence[DecodeSide], now: float, arrival: float | None = None,
                 final: bool = True) -> Booking:
        """Route over the live workers, decide on the chosen pair's ledgers, book both; raises
        `NoWorkerAvailableError` (none alive) or the rejection (`OverloadedError`). `arrival`:
        when it arrived, if the admission window held it (default: now). Not `final`: a refusal
        that may get a second look raises `SecondLook` instead (counted nowhere yet)."""
        objective = self.objective(ask)
        for side in prefill:  # how the workers step: their ledgers lay their queues out so
            side.ledger.use(self.prefill_steps)
        try:
            plan = self.route(ask, prefix, objective, prefill, decode, now)
        except OverloadedError as e:  # no decode worker has the KV free
            self.stats.rejected(objective.slo_class.name, e.reason or "kv_capacity")
            raise
        chosen = next(e for e in plan.per_worker if e.worker_id == plan.prefill_id)
        steps = self.prefill_steps  # a long prompt's chunks are steps of their own
        alone = chosen.prefill_ms if steps is None else steps.alone_ms(ask.prompt_len - plan.prefix_len, plan.prefix_len)
        cost_ms = alone + chosen.transfer_ms
        arrived = now if arrival is None else min(arrival, now)
        candidate = self.admission.candidate(objective, ask.prompt_len, ask.max_tokens, cost_ms,
                                             self.block_size, arrived, ask.prompt_len - plan.prefix_len,
                                             (now - arrived) * 1e3, chosen.transfer_ms, ask.choices)
        p = next(s for s in prefill if s.worker_id == plan.prefill_id)
        d = next(s for s in decode if s.worker_id == plan.decode_id)
        return self._book(ask, objective, candidate, p, d, plan.prefix_len, now, plan.fetch_from, final)

    def route(self, ask: Ask, prefix: PrefixMatch, objective: Objective, prefill: Sequence[PrefillSide],
              decode: Sequence[DecodeSide], now: float) -> RoutePlan:
        """Mooncake Algorithm 1 over the ledgers (queues in the request's priority order)."""
        request = RouteRequest(ask.prompt_len, ask.max_tokens, prefix.best_tokens,
                               prefix.best_holder if prefix.best_tokens else None)
        prefill_views = [PrefillView(s.worker_id, prefix.per_worker.get(s.worker_id, 0),
                                     s.ledger.wait_ms(objective.rank, now), s.alive,
                                     prefix.adapter_ms.get(s.worker_id, 0.0)) for s in prefill]
        decode_views = [DecodeView(s.worker_id, len(s.ledger.jobs),
                                   sum(b.prompt_len + b.generated for b in s.ledger.jobs.values()),
                                   s.ledger.free_blocks, s.alive) for s in decode]
        return self.router.route(request, prefill_views, decode_views)

    # ------------------------------------------------------------------ co-located

    def dispatch_colocated(self, ask: Ask, cached_tokens: int, pending: PrefillLedger,
                           bound: DecodeLedger, now: float, arrival: float | None = None) -> Booking:
        """One engine: its waiting requests are the prefill ledger, every request in it the
        decode ledger; `cached_tokens` of the prompt are in its prefix cache."""
        objective = self.objective(ask)
        n = ask.prompt_len
        cached = max(0, min(cached_tokens, n - 1))
        arrived = now if arrival is None else min(arrival, now)
        candidate = self.admission.candidate(objective, n, ask.max_tokens, self.colocated_prefill_ms(n - cached, cached,
                                                                                                    bound, now),
                                             self.block_size, arrived, new_tokens=n - cached,
                                             held_ms=(now - arrived) * 1e3, choices=ask.choices)
        return self._book(ask, objective, candidate, PrefillSide(COLOCATED, pending),
                          DecodeSide(COLOCATED, bound), cached, now)

    def colocated_prefill_ms(self, new: int, cached: int, bound: DecodeLedger, now: float) -> float:
        """A prefill in a co-located engine: its chunks, each in a step that also decodes the
        running batch (the steps' decode part is the batch decoding now)."""
        chunk = self.admission.colocated_chunk
        prefill = self.cost.est_prefill_ms(new, cached)
        if chunk is None or new <= 0:
            return prefill
        running = [j for j in bound.decode_jobs(now) if j.joins_at_ms <= 0]
        if not running:
            return prefill
        step = self.cost.est_decode_step_ms(len(running), sum(j.context_tokens for j in running))
        return prefill + cdiv(new, chunk) * step

    # ------------------------------------------------------------------ both

    def _book(self, ask: Ask, objective: Objective, candidate: Candidate, p: PrefillSide, d: DecodeSide,
              prefix_tokens: int, now: float, fetch_from: str | None = None, final: bool = True) -> Booking:
        name = objective.slo_class.name
        decision = self.admission.decide(candidate, p.ledger, d.ledger, now, final or ask.resumed)
        if ask.resumed and decision.reason is not Reason.KV_CAPACITY:
            decision = replace(decision, reason=None)  # promised service once: only room can stop it
        if not decision.admitted and not final and decision.second_look_s > 0:
            raise SecondLook(decision.second_look_s)
        if not decision.admitted:
            self.stats.rejected(name, decision.reason or "")
            raise decision.error()
        if not ask.resumed:
            self.stats.admitted(name)
        chunk = self.admission.colocated_chunk
        chunks = cdiv(candidate.new_tokens, chunk) if chunk else 0
        p.ledger.add(candidate.prefill_job(ask.request_id, now, chunks))
        bound = BoundRequest(ask.request_id, ask.prompt_len, candidate.expected_output, objective.tbt_ms,
                             now + decision.joins_in_ms / 1e3, candidate.blocks, choices=candidate.choices)
        d.ledger.book(bound)
        return Booking(ask.request_id, objective, candidate, decision, bound, p.worker_id, d.worker_id,
                       prefix_tokens, fetch_from)

    def finished(self, booking: Booking, completion_tokens: int, max_tokens: int, ttft_s: float,
                 tbt_s: float | None) -> None:
        """An admitted request ended with its result: what it measured corrects later predictions
        (its TBT only from MIN_SAMPLE_GAPS gaps up: see there)."""
        self.admission.outputs.observe(booking.objective.slo_class.name, completion_tokens, max_tokens)
        if completion_tokens - 1 < MIN_SAMPLE_GAPS:
            tbt_s = None
        p = booking.decision.prediction
        self.stats.measured(p.predicted_ttft_ms, ttft_s, p.predicted_tbt_ms, tbt_s)
        self.admission.observe(booking.decision, ttft_s, tbt_s)
