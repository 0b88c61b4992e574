"""Admission: whether a request goes in, decided before any work is spent on it.

Every request has objectives: its priority class's TTFT/TBT SLOs (server-side defaults, so
overload is handled even when clients send none), which its own `ttft_ms`/`tbt_ms` override.
After routing picks the prefill and decode workers, the policy decides:

| policy            | rejects when                                                              |
|-------------------|---------------------------------------------------------------------------|
| `none`            | never for load (only a full queue or no KV: nothing can take it)          |
| `queue-threshold` | the prefill worker has `queue_threshold` requests pending                 |
| `early`           | the load *now* predicts a miss: queue + prefill > TTFT, step now > TBT    |
| `predictive`      | Mooncake §7 (default): TTFT on the prefill worker (queue served before it,|
|                   | prefill, fetch, the decode side's first step) > TTFT, or the decode batch |
|                   | at any moment of its stay (conductor/prediction.py) > the tightest TBT    |
|                   | objective in it; or it would push a queued request past its deadline      |

Every policy also rejects when the worker's queue holds `max_queue_per_worker` requests
(`queue_full`) or no decode worker has the request's KV free (`kv_capacity`). A class without
objectives (`batch`) is shed first: it is admitted only while a request of the lowest class that
has objectives would be, with `shed_headroom` of its SLOs to spare. A rejection is a clean 429 /
RESOURCE_EXHAUSTED carrying the predictions, the objectives and a Retry-After hint.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

from halfmoon.conductor.backend import Slo
from halfmoon.conductor.calibration import Calibration, Fit
from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.errors import OverloadedError, SloMissError
from halfmoon.conductor.ledger import DecodeLedger, PendingPrefill, PrefillLedger
from halfmoon.conductor.prediction import DecodeJob, DecodeLoadPredictor
from halfmoon.core.blocks import cdiv
from halfmoon.core.errors import ConfigError, InvalidRequestError, check_positive
from halfmoon.core.messages import SloPrediction

log = logging.getLogger(__name__)

RETRY_MIN_S, RETRY_MAX_S = 0.5, 30.0


class Policy(enum.StrEnum):
    NONE = "none"
    QUEUE_THRESHOLD = "queue-threshold"
    EARLY = "early"
    PREDICTIVE = "predictive"


SECOND_LOOK_MIN_S = 0.05  # less time left than this: refused at once
# A decision that can be made again later admits only this far under the TTFT objective (what is
# still to come, x this): a request at the margin waits for the queue ahead to be measured.
SECOND_LOOK_MARGIN = 1.3


class Reason(enum.StrEnum):
    """Why a request was rejected (the `reason` label of the admission metrics)."""

    TTFT = "ttft"  # predicted TTFT over its objective
    TBT = "tbt"  # predicted TBT over the tightest objective of a batch it joins
    DEADLINE = "deadline"  # it would push a queued request past its deadline
    SHED = "shed"  # a class without objectives, shed while others are near theirs
    QUEUE_THRESHOLD = "queue_threshold"
    QUEUE_FULL = "queue_full"
    KV_CAPACITY = "kv_capacity"


@dataclass(frozen=True, slots=True)
class SloClass:
    """A priority class: `rank` orders queues (higher first); None = no objective."""

    name: str
    rank: int
    ttft_ms: float | None
    tbt_ms: float | None

    @property
    def has_slo(self) -> bool:
        return self.ttft_ms is not None or self.tbt_ms is not None


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Admission and priority classes (`halfmoon serve --admission ...`, HALFMOON_ADMISSION, Helm
    `admission.*`).

    admission: the policy (none, queue-threshold, early, predictive).
    default_class: the class of a request that names none.
    interactive_ttft_ms / interactive_tbt_ms: the `interactive` class's SLOs (0 = none).
    standard_ttft_ms / standard_tbt_ms: the `standard` class's SLOs (0 = none).
    batch_ttft_ms / batch_tbt_ms: the `batch` class's SLOs (0 = none: shed first).
    queue_threshold: `queue-threshold` policy: pending prefills per worker before rejecting.
    max_queue_per_worker: every policy: requests pending on one prefill worker at most.
    shed_headroom: a class without SLOs is admitted while predictions stay within this fraction
        of the lowest SLO class's objectives.
    admit_quantile: predictions are reported at the median of what admitted requests measured
        against them, but tested against the objectives at this quantile (0.5 = the median):
        half of the requests predicted right at their SLO would otherwise miss it.
    admit_window_ms: cluster mode: arrivals are held this long (from the first one held), then
        decided highest class and shortest predicted prefill first (conductor/admission_window.py);
        0 = each as it arrives. Co-located mode decides each as it arrives.
    second_look: with a window, a request refused only for its predicted TTFT that would still
        fit on idle workers is not refused yet: it is decided again each time a prefill ends (the
        queue ahead measured, not predicted), until it fits or its latest start passes, and only
        then refused (conductor/admission_window.py); while it may still get one, a request is
        admitted only `SECOND_LOOK_MARGIN` under its TTFT objective (else kept: never refused for
        the margin). False = decided at once, at the guard.
    """

    admission: str = Policy.PREDICTIVE.value
    default_class: str = "standard"
    interactive_ttft_ms: float = 1000.0
    interactive_tbt_ms: float = 100.0
    standard_ttft_ms: float = 2000.0
    standard_tbt_ms: float = 150.0
    batch_ttft_ms: float = 0.0
    batch_tbt_ms: float = 0.0
    queue_threshold: int = 4
    max_queue_per_worker: int = 128
    shed_headroom: float = 0.8
    admit_quantile: float = 0.9
    admit_window_ms: float = 20.0
    second_look: bool = True

    def __post_init__(self) -> None:
        if self.admission not in {p.value for p in Policy}:
            raise ConfigError(f"admission must be one of {[p.value for p in Policy]}, got {self.admission!r}")
        if self.default_class not in self.classes():
            raise ConfigError(f"default_class must be one of {sorted(self.classes())}, got {self.default_class!r}")
        for name in ("interactive_ttft_ms", "interactive_tbt_ms", "standard_ttft_ms", "standard_tbt_ms",
                     "batch_ttft_ms", "batch_tbt_ms"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ConfigError(f"{name} must be a finite number >= 0 (0 = no objective), got {getattr(self, name)}")
        check_positive(self, "queue_threshold", "max_queue_per_worker", "shed_headroom")
        if not 0 <= self.admit_window_ms <= 10_000:
            raise ConfigError(f"admit_window_ms must be in [0, 10000], got {self.admit_window_ms}")
        if not 0.5 <= self.admit_quantile < 1:
            raise ConfigError(f"admit_quantile must be in [0.5, 1), got {self.admit_quantile}")

    @property
    def policy(self) -> Policy:
        return Policy(self.admission)

    def classes(self) -> dict[str, SloClass]:
        """The priority classes by name (highest rank first)."""
        def objective(ms: float) -> float | None:
            return ms or None

        return {"interactive": SloClass("interactive", 2, objective(self.interactive_ttft_ms),
                                        objective(self.interactive_tbt_ms)),
                "standard": SloClass("standard", 1, objective(self.standard_ttft_ms), objective(self.standard_tbt_ms)),
                "batch": SloClass("batch", 0, objective(self.batch_ttft_ms), objective(self.batch_tbt_ms))}


@dataclass(frozen=True, slots=True)
class Objective:
    """A request's resolved class and objectives (ms; inf = none)."""

    slo_class: SloClass
    ttft_ms: float
    tbt_ms: float
    own_ttft: bool = False  # set by the request itself (else its class's)
    own_tbt: bool = False

    @property
    def rank(self) -> int:
        return self.slo_class.rank

    @property
    def has_slo(self) -> bool:
        return math.isfinite(self.ttft_ms) or math.isfinite(self.tbt_ms)


def resolve(config: AdmissionConfig, class_name: str | None, override: Slo, field: str = "priority_class") -> Objective:
    """The request's class (its own, else the default) and objectives (its own, else the class's).
    An unknown class is InvalidRequestError naming `field`."""
    classes = config.classes()
    name = class_name or config.default_class
    if name not in classes:
        raise InvalidRequestError(field, f"{name!r} is not a priority class; one of {sorted(classes)}")
    cls = classes[name]
    ttft = override.ttft_ms if override.ttft_ms is not None else cls.ttft_ms
    tbt = override.tbt_ms if override.tbt_ms is not None else cls.tbt_ms
    return Objective(cls, math.inf if ttft is None else ttft, math.inf if tbt is None else tbt,
                     override.ttft_ms is not None, override.tbt_ms is not None)


class OutputEstimator:
    """A running estimate of output length per class, as a fraction of max_tokens (requests stop
    early at EOS): an exponentially weighted mean, 1.0 (= max_tokens) until the first finish."""

    ALPHA = 0.1

    def __init__(self) -> None:
        self._ratio: dict[str, float] = {}

    def expected(self, class_name: str, max_tokens: int) -> int:
        return max(1, min(max_tokens, math.ceil(max_tokens * self._ratio.get(class_name, 1.0))))

    def observe(self, class_name: str, generated: int, max_tokens: int) -> None:
        ratio = min(1.0, generated / max_tokens) if max_tokens > 0 else 1.0
        old = self._ratio.get(class_name)
        self._ratio[class_name] = ratio if old is None else (1 - self.ALPHA) * old + self.ALPHA * ratio


@dataclass(frozen=True, slots=True)
class Candidate:
    """A routed request as admission sees it.

    prefill_ms: predicted prefill + fetch on the chosen prefill worker.
    blocks: KV blocks it needs on the decode worker (prompt + max_tokens; n > 1: each other
        choice's copy of the partial last prompt block and its own outputs').
    deadline: monotonic s when its first token is due (inf = no TTFT objective).
    new_tokens: prompt tokens it computes (the rest are a cached prefix).
    held_ms: how long the admission window held it before this decision (conductor/
        admission_window.py): part of its TTFT, spent before any prediction starts.
    fetch_ms: of prefill_ms, pulling a prefix from another worker.
    """

    objective: Objective
    prompt_len: int
    max_tokens: int
    expected_output: int
    prefill_ms: float
    blocks: int
    deadline: float
    new_tokens: int
    held_ms: float = 0.0
    fetch_ms: float = 0.0
    choices: int = 1  # sequences it decodes (SamplingParams.n), sharing the prompt's blocks

    @property
    def queue_deadline(self) -> float:
        """Its place in the prefill queue: the decision time + its TTFT objective (a window's
        requests in the window's order; `PendingPrefill.queue_deadline`)."""
        return self.deadline + self.held_ms / 1e3

    def prefill_job(self, request_id: str, now: float, chunks: int = 0) -> PendingPrefill:
        """Its prefill as a ledger entry sent at `now`."""
        return PendingPrefill(request_id, self.objective.rank, self.deadline, self.prefill_ms, now, chunks,
                              new_tokens=self.new_tokens, cached_tokens=self.prompt_len - self.new_tokens,
                              fetch_ms=self.fetch_ms, queue_deadline=self.queue_deadline)


@dataclass(frozen=True, slots=True)
class Decision:
    """Admitted (reason None) or rejected, with the predictions it was decided on."""

    reason: Reason | None
    prediction: SloPrediction
    retry_after_s: float = 0.0
    detail: str = ""
    joins_in_ms: float = 0.0  # predicted end of its prefill (it joins the decode batch), ms from now
    raw_ttft_ms: float = 0.0  # the cost model's predictions before calibration
    raw_tbt_ms: float = 0.0
    second_look_s: float = 0.0  # refused for TTFT alone, it fits idle if its prefill starts within this

    @property
    def admitted(self) -> bool:
        return self.reason is None

    def error(self) -> OverloadedError:
        """The rejection as the front door reports it (429 / RESOURCE_EXHAUSTED)."""
        assert self.reason is not None
        if self.reason in (Reason.TTFT, Reason.TBT, Reason.DEADLINE, Reason.SHED):
            return SloMissError(self.prediction, self.retry_after_s, self.reason.value, self.detail)
        return OverloadedError(self.detail, self.retry_after_s, self.reason.value, self.prediction)


class Predicted(NamedTuple):
    ttft_ms: float
    tbt_ms: float
    tbt_limit_ms: float  # the tightest objective of the batch where tbt_ms was predicted
    retry_tbt_s: float  # when the decode batch it meets first loses a member
    first_step_ms: float = 0.0  # end of prefill -> first token (the decode step it rides)
    stretched_ms: float = 0.0  # co-located: the running batch's step while this prefill runs
    stretched_limit_ms: float = math.inf  # the tightest objective of that batch


class Admission:
    """Decides with one policy over the Conductor's ledgers (see the module docstring)."""

    def __init__(self, config: AdmissionConfig, cost: CostModel, colocated_chunk: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`colocated_chunk`: prefill and decode share one engine whose steps carry up to this
        many prefill tokens: a prefill stretches the steps of every request decoding meanwhile.
        `clock`: the calibration window's time (the simulator's own clock in `sim/`)."""
        self.config = config
        self.colocated_chunk = colocated_chunk
        self.policy = config.policy
        self.predictor = DecodeLoadPredictor(cost)
        self.cost = cost
        self.outputs = OutputEstimator()
        self.calibration = Calibration(config.admit_quantile, clock)
        self._warned: set[str] = set()
        with_slo = [c for c in config.classes().values() if c.has_slo]
        self._shed_class = min(with_slo, key=lambda c: c.rank) if with_slo else None

    def candidate(self, objective: Objective, prompt_len: int, max_tokens: int, prefill_ms: float,
                  block_size: int, arrival: float, new_tokens: int | None = None,
                  held_ms: float = 0.0, fetch_ms: float = 0.0, choices: int = 1) -> Candidate:
        """`new_tokens`: the prompt tokens not in a cached prefix (default: all); `held_ms`: the
        time since `arrival` the admission window held it; `fetch_ms`: of `prefill_ms`, pulling
        a prefix from another worker; `choices`: n (each choice's blocks beyond the shared
        full prompt blocks are priced too)."""
        deadline = arrival + objective.ttft_ms / 1e3 if math.isfinite(objective.ttft_ms) else math.inf
        blocks = cdiv(prompt_len + max_tokens, block_size)
        blocks += (choices - 1) * (blocks - prompt_len // block_size)
        return Candidate(objective, prompt_len, max_tokens, self.outputs.expected(objective.slo_class.name, max_tokens),
                         prefill_ms, blocks, deadline,
                         prompt_len if new_tokens is None else new_tokens, max(0.0, held_ms), fetch_ms, choices)

    def decide(self, c: Candidate, prefill: PrefillLedger, decode: DecodeLedger, now: float,
               final: bool = True) -> Decision:
        """Admit or reject `c` on the chosen workers' ledgers (predictions as calibrated). Not
        `final` (a look it may get again), it is admitted only with `SECOND_LOOK_MARGIN`."""
        raw = self.predict(c, prefill, decode, now)
        p = self._calibrated(raw)
        joins_in_ms = p.ttft_ms - p.first_step_ms
        if c.held_ms > 0:  # the window's hold is spent already: part of the TTFT, exactly
            raw, p = raw._replace(ttft_ms=raw.ttft_ms + c.held_ms), p._replace(ttft_ms=p.ttft_ms + c.held_ms)
        decision = self._decide(c, p, prefill, decode, now, final)
        if decision.admitted:
            self.calibration.admitted()
        elif final:
            self.calibration.refused()
        return replace(decision, joins_in_ms=joins_in_ms, raw_ttft_ms=raw.ttft_ms, raw_tbt_ms=raw.tbt_ms)

    def _calibrated(self, p: Predicted) -> Predicted:
        t, b = self.calibration.ttft, self.calibration.tbt
        return p._replace(ttft_ms=t(p.ttft_ms), tbt_ms=b(p.tbt_ms), first_step_ms=p.first_step_ms * t.scale,
                          stretched_ms=b(p.stretched_ms) if p.stretched_ms > 0 else 0.0)

    def observe(self, decision: Decision, ttft_s: float, tbt_s: float | None) -> None:
        """An admitted request finished: what it measured corrects later predictions."""
        self.calibration.observe(decision.raw_ttft_ms, ttft_s * 1e3, decision.raw_tbt_ms,
                                 None if tbt_s is None else tbt_s * 1e3)

    def _decide(self, c: Candidate, p: Predicted, prefill: PrefillLedger, decode: DecodeLedger,
                now: float, final: bool = True) -> Decision:
        prediction = self._prediction(c.objective, p)
        if prefill.depth >= self.config.max_queue_per_worker:
            return self._queue_reject(Reason.QUEUE_FULL, prefill, now, prediction,
                                      f"{prefill.depth} requests are waiting for their first token on this "
                                      f"worker (limit {self.config.max_queue_per_worker}); retry later")
        if decode.free_blocks < c.blocks:
            return Decision(Reason.KV_CAPACITY, prediction, _clamp(p.retry_tbt_s),
                            f"no decode worker has {c.blocks} KV blocks free for {c.prompt_len} prompt + "
                            f"{c.max_tokens} output tokens (most free: {decode.free_blocks})")
        if self.policy is Policy.QUEUE_THRESHOLD and prefill.depth >= self.config.queue_threshold:
            return self._queue_reject(Reason.QUEUE_THRESHOLD, prefill, now, prediction,
                                      f"{prefill.depth} requests are queued on the prefill worker "
                                      f"(threshold {self.config.queue_threshold})")
        if self.policy in (Policy.EARLY, Policy.PREDICTIVE):
            return self._check_objectives(c, p, prediction, prefill, now, final)
        return Decision(None, prediction)

    def predict(self, c: Candidate, prefill: PrefillLedger, decode: DecodeLedger, now: float) -> Predicted:
        """TTFT and TBT as the policy sees them: the load at arrival and over the request's stay
        (predictive), or the load now (every other policy: reported, and checked by `early`)."""
        jobs = decode.decode_jobs(now)
        step_now = self.predictor.step_ms_now(jobs)
        retry = min((j.leaves_at_ms(step_now) for j in jobs), default=0.0) / 1e3
        if self.policy is not Policy.PREDICTIVE:
            ttft = prefill.wait_ms(-1, now) + c.prefill_ms + self.cost.overhead_ms
            running = [j for j in jobs if j.joins_at_ms <= 0]
            tbt = self.cost.est_decode_step_ms(len(running) + 1, sum(j.context_tokens for j in running) + c.prompt_len)
            return Predicted(ttft, tbt / decode.tokens_per_step, c.objective.tbt_ms, retry)
        # its end of prefill in its place in the queue (a cluster's worker batches: the step its
        # last chunk rides), then the handoff: RPCs, KV, the decode join (`CostModel.overhead_ms`)
        arrive = prefill.end_ms(c.prefill_job("", now), now) + self.cost.overhead_ms
        # The first token rides a decode step; co-located, the prefill's last chunk samples it
        # (c.prefill_ms already holds the running batch's steps its chunks share).
        first_step = 0.0
        if self.colocated_chunk is None:
            first = self.predictor.predict(jobs, arrive, c.prompt_len)
            # joining a batch that is decoding, it waits for the step in progress: half of one, on average
            first_step = first.tbt_ms * (1.5 if first.batch > 1 else 1.0)
        peak = self.predictor.peak(jobs, arrive, c.prompt_len, c.expected_output, c.objective.tbt_ms, c.choices)
        stretched, limit = self._stretched(c, jobs, prefill)
        # a step emits tokens_per_step tokens a request (speculative decoding): TBT counts each
        tbt = peak.tbt_ms / decode.tokens_per_step
        return Predicted(arrive + first_step, tbt, peak.limit_ms, retry, first_step, stretched, limit)

    def _stretched(self, c: Candidate, jobs: list[DecodeJob], prefill: PrefillLedger) -> tuple[float, float]:
        """Co-located: the TBT its prefill gives the requests that decode while it runs, and their
        objective (the one nearest to being missed; 0, inf when there are none). Its prefill runs
        as ceil(new / chunk) steps each stretched by a chunk. A request decoding now also sees
        the chunks of the prefills queued before it; one still in prefill (ahead in the queue)
        decodes by the time the candidate's chunks run and sees those. A request's TBT (the mean
        of its longest tenth of gaps) takes as many stretched steps as fit in that tenth and in
        what it has left to decode."""
        if self.colocated_chunk is None or not jobs or c.new_tokens <= 0:
            return 0.0, math.inf
        step = self.cost.est_decode_step_ms(len(jobs), sum(j.context_tokens for j in jobs))
        stretched = step + self.cost.est_prefill_ms(min(self.colocated_chunk, c.new_tokens))
        own = cdiv(c.new_tokens, self.colocated_chunk)
        ahead = own + sum(p.chunks for p in prefill.jobs.values())
        worst = (0.0, math.inf)
        for j in jobs:
            top = j.top_gaps
            hit = min(ahead if j.joins_at_ms <= 0 else own, top, j.remaining_tokens)
            tbt = (hit * stretched + (top - hit) * step) / top
            if tbt / j.tbt_slo_ms > worst[0] / worst[1]:
                worst = (tbt, j.tbt_slo_ms)
        return worst if worst[0] > 0 else (stretched, math.inf)

    def _check_objectives(self, c: Candidate, p: Predicted, prediction: SloPrediction,
                          prefill: PrefillLedger, now: float, final: bool = True) -> Decision:
        """Every objective the request would miss (the first one names the reason)."""
        o = c.objective
        ttft_limit, tbt_limit, stretch_limit = o.ttft_ms, min(o.tbt_ms, p.tbt_limit_ms), p.stretched_limit_ms
        shed = not o.has_slo and self._shed_class is not None
        if shed:
            h, cls = self.config.shed_headroom, self._shed_class
            ttft_limit = h * (cls.ttft_ms or math.inf)
            tbt_limit = h * min(cls.tbt_ms or math.inf, p.tbt_limit_ms)
            stretch_limit *= h
        # What the hardware gives a request alone is not load: a class objective below it admits
        # requests when nothing competes with them instead of rejecting every one (a long
        # prompt admitted so also warms the prefix cache for the requests that share it). An
        # objective the request set itself stays strict (it asked to fail fast).
        idle_ttft, idle_tbt = self._idle(c)
        # Tested at the admit quantile of past errors (the floor too), reported at the median.
        t, b = self.calibration.ttft, self.calibration.tbt
        # The floor is the time on idle workers, not the admission window's hold: a held request
        # that misses even on idle workers is refused (admitting such requests lowered goodput
        # and admitted-within-SLO on the bundled trace: docs/BENCHMARKS.md, issue 38).
        if not o.own_ttft:
            ttft_limit = max(ttft_limit, t.guarded(idle_ttft))
        if not o.own_tbt:
            tbt_limit = max(tbt_limit, b.guarded(idle_tbt))
        misses: list[tuple[Reason, float, str]] = []
        # the time held already is measured, not predicted: the guard prices what is to come
        ttft_guarded = c.held_ms + t.guarded(p.ttft_ms - c.held_ms)
        q = self.calibration.quantile
        if ttft_guarded > ttft_limit:
            misses.append((Reason.TTFT, (ttft_guarded - ttft_limit) / 1e3,
                           f"predicted TTFT {p.ttft_ms:.0f} ms{_guarded(ttft_guarded, p.ttft_ms, q)} "
                           f"> {ttft_limit:.4g} ms"))
        if b.guarded(p.tbt_ms) > tbt_limit:
            misses.append((Reason.TBT, p.retry_tbt_s,
                           f"predicted TBT {p.tbt_ms:.1f} ms{_guarded(b.guarded(p.tbt_ms), p.tbt_ms, q)} > "
                           f"{tbt_limit:.4g} ms (the tightest objective of its batch)"))
        if p.stretched_ms > 0 and b.guarded(p.stretched_ms) > stretch_limit:
            misses.append((Reason.TBT, p.retry_tbt_s, "its prefill would stretch the running requests' steps to "
                           f"{p.stretched_ms:.1f} ms > {stretch_limit:.4g} ms (the tightest objective among them)"))
        if not misses and self.policy is Policy.PREDICTIVE:
            late = prefill.pushed_past_deadline(c.prefill_job("", now), now,
                                                p.first_step_ms + self.cost.overhead_ms)
            if late is not None:
                misses.append((Reason.DEADLINE, c.prefill_ms / 1e3,
                               f"it would push queued request {late.request_id} past its TTFT deadline"))
        if not misses:
            return self._margin(c, p, prediction, idle_ttft, t, final)
        reason = Reason.SHED if shed else misses[0][0]
        look = self._second_look_s(c, t.guarded(idle_ttft), o.ttft_ms) if {m[0] for m in misses} == {Reason.TTFT} else 0.0
        return Decision(reason, prediction, _clamp(max(m[1] for m in misses)), "; ".join(m[2] for m in misses),
                        second_look_s=0.0 if shed else look)

    def _margin(self, c: Candidate, p: Predicted, prediction: SloPrediction, alone_ms: float, fit: Fit,
                final: bool) -> Decision:
        """Admitted at the guard; while it may get a second look, the wait for the queue ahead
        (what a later look knows better; its own prefill it never will) is priced at
        `SECOND_LOOK_MARGIN`, else it is kept for a look with more of that queue measured. Never
        refused for the margin alone; with nothing ahead, the margin is moot."""
        alone_guarded_ms = fit.guarded(alone_ms)
        look = 0.0 if final else self._second_look_s(c, alone_guarded_ms, c.objective.ttft_ms)
        ahead_ms = max(0.0, p.ttft_ms - c.held_ms - alone_ms)
        margin = max(fit.guard, SECOND_LOOK_MARGIN)
        if look > 0 and c.held_ms + alone_guarded_ms + ahead_ms * margin > c.objective.ttft_ms:
            return Decision(Reason.TTFT, prediction, _clamp(look), f"predicted TTFT {p.ttft_ms:.0f} ms within "
                            f"{margin:.2f}x of {c.objective.ttft_ms:.4g} ms: kept for a second look", second_look_s=look)
        return Decision(None, prediction)

    def _second_look_s(self, c: Candidate, alone_ms: float, ttft_ms: float) -> float:
        """How long a TTFT refusal may wait for a second look (`AdmissionConfig.second_look`): the
        time left to start its prefill and still meet the objective on idle workers (0: none)."""
        if not (self.config.second_look and self.policy is Policy.PREDICTIVE and math.isfinite(ttft_ms)):
            return 0.0
        left_s = (ttft_ms - c.held_ms - alone_ms) / 1e3
        return left_s if left_s >= SECOND_LOOK_MIN_S else 0.0

    def _idle(self, c: Candidate) -> tuple[float, float]:
        """TTFT and TBT of `c` on idle workers, calibrated (warned once per class over its SLOs)."""
        step = self.cost.est_decode_step_ms(1, c.prompt_len + c.expected_output)
        ttft, tbt = self.calibration.ttft(c.prefill_ms + self.cost.overhead_ms + step), self.calibration.tbt(step)
        o = c.objective
        over = (ttft > o.ttft_ms and not o.own_ttft) or (tbt > o.tbt_ms and not o.own_tbt)
        if over and o.slo_class.name not in self._warned:
            self._warned.add(o.slo_class.name)
            log.warning("admission: a %s request alone is predicted at TTFT %.0f ms / TBT %.1f ms, over its "
                        "objectives (%.4g / %.4g ms): this hardware cannot meet them even idle; such "
                        "requests are admitted when nothing competes with them", o.slo_class.name, ttft, tbt,
                        o.ttft_ms, o.tbt_ms)
        return ttft, tbt

    def _queue_reject(self, reason: Reason, prefill: PrefillLedger, now: float, prediction: SloPrediction,
                      detail: str) -> Decision:
        plan = prefill.plan(now)
        return Decision(reason, prediction, _clamp(plan[0].end_ms / 1e3 if plan else 0.0), detail)

    @staticmethod
    def _prediction(o: Objective, p: Predicted) -> SloPrediction:
        def slo(ms: float) -> float:
            return ms if math.isfinite(ms) else 0.0

        return SloPrediction(p.ttft_ms, p.tbt_ms, slo(o.ttft_ms), slo(o.tbt_ms))


def _guarded(guarded_ms: float, calibrated_ms: float, quantile: float) -> str:
    guard = guarded_ms / calibrated_ms if calibrated_ms > 0 else 1.0
    return f" (x{guard:.2f} at the p{quantile * 100:.0f} of past errors)" if guard > 1.0 + 1e-9 else ""


def _clamp(seconds: float) -> float:
    return min(RETRY_MAX_S, max(RETRY_MIN_S, seconds))
