"""Admission on a synthetic cost model (pure: no engine, no workers): what fits is admitted, what
would miss TTFT or TBT is rejected with that reason, and the decode load is predicted for when the
request arrives, not for now."""

from __future__ import annotations

import math
import random

import pytest

from halfmoon.conductor.admission import Admission, AdmissionConfig, Objective, OutputEstimator, Policy, Reason, resolve
from halfmoon.conductor.admission_stats import AdmissionStats, Histogram, TopGaps
from halfmoon.conductor.backend import Slo
from halfmoon.conductor.calibration import IDENTITY, Calibration, Fit, fit_samples
from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.errors import OverloadedError, SloMissError, status_of
from halfmoon.conductor.ledger import BoundRequest, DecodeLedger, PendingPrefill, PrefillLedger
from halfmoon.conductor.prediction import DecodeJob, DecodeLoadPredictor
from halfmoon.core.errors import ConfigError, InvalidRequestError

BS = 16
NOW = 1000.0  # monotonic seconds
# prefill: 1 ms per new token; decode step: 50 ms + 10 ms per request in the batch.
COST = CostModel(prefill_coef=(0.0, 1.0, 0.0, 0.0), decode_coef=(50.0, 10.0, 0.0),
                 transfer_bytes_per_s=1e9, kv_bytes_per_token=1)


def admission(policy: str = "predictive", **overrides: object) -> Admission:
    return Admission(AdmissionConfig(admission=policy, **overrides), COST)  # type: ignore[arg-type]


def objective(ttft_ms: float = 2000.0, tbt_ms: float = 150.0, cls: str = "standard") -> Objective:
    """The class's objectives (as a server's defaults, not the request's own)."""
    cfg = AdmissionConfig(**{f"{cls}_ttft_ms": ttft_ms, f"{cls}_tbt_ms": tbt_ms})  # type: ignore[arg-type]
    return resolve(cfg, cls, Slo())


def decide(adm: Admission, prompt: int = 500, max_tokens: int = 20, obj: Objective | None = None,
           prefill: PrefillLedger | None = None, decode: DecodeLedger | None = None):
    c = adm.candidate(obj or objective(), prompt, max_tokens, COST.est_prefill_ms(prompt), BS, NOW)
    return adm.decide(c, prefill or PrefillLedger(), decode or DecodeLedger(total_blocks=1000), NOW)


def queued(*costs_ms: float, rank: int = 1) -> PrefillLedger:
    ledger = PrefillLedger()
    for i, cost in enumerate(costs_ms):
        ledger.add(PendingPrefill(f"q{i}", rank, NOW + 1.0, cost, NOW))  # due before a new one
    return ledger


def decoding(n: int, remaining: int = 100, joins_in_s: float = 0.0, tbt_slo_ms: float = math.inf) -> DecodeLedger:
    ledger = DecodeLedger(total_blocks=1000)
    for i in range(n):
        ledger.book(BoundRequest(f"d{i}", 100, remaining, tbt_slo_ms, NOW + joins_in_s, 10))
    return ledger


# ---------------------------------------------------------------------- the decisions


def test_a_request_that_fits_is_admitted_with_its_predictions() -> None:
    d = decide(admission())
    assert d.admitted and d.reason is None
    # TTFT: 500 ms prefill + the first decode step (batch of 1: 60 ms); TBT: 60 ms.
    assert d.prediction.predicted_ttft_ms == pytest.approx(560.0)
    assert d.prediction.predicted_tbt_ms == pytest.approx(60.0)
    assert (d.prediction.ttft_slo_ms, d.prediction.tbt_slo_ms) == (2000.0, 150.0)
    assert d.joins_in_ms == pytest.approx(500.0)


def test_a_request_behind_a_long_queue_is_rejected_for_ttft() -> None:
    d = decide(admission(), prefill=queued(800.0, 900.0))
    assert d.reason is Reason.TTFT
    assert d.prediction.predicted_ttft_ms == pytest.approx(800 + 900 + 500 + 60)
    err = d.error()
    assert isinstance(err, SloMissError) and status_of(err).http == 429
    assert err.reason == "ttft" and err.prediction == d.prediction
    assert err.retry_after_s == pytest.approx((2260 - 2000) / 1e3, abs=0.5)


def test_a_request_joining_a_full_batch_is_rejected_for_tbt() -> None:
    # 10 running: 50 + 10 * 11 = 160 ms > 150 ms.
    d = decide(admission(), decode=decoding(10))
    assert d.reason is Reason.TBT
    assert d.prediction.predicted_tbt_ms == pytest.approx(160.0)


def test_the_tightest_objective_of_the_batch_binds() -> None:
    """Alone it would meet its own 150 ms, but a running request asked for 80 ms."""
    d = decide(admission(), decode=decoding(2, tbt_slo_ms=80.0))  # 50 + 10 * 3 = 80: fits exactly
    assert d.admitted
    d = decide(admission(), decode=decoding(3, tbt_slo_ms=80.0))  # 90 > 80
    assert d.reason is Reason.TBT


def test_requests_that_finish_before_arrival_do_not_count() -> None:
    """10 requests decode now but finish within 5 steps; the new one arrives after a 2 s prefill."""
    d = decide(admission(), prompt=2000, obj=objective(ttft_ms=5000), decode=decoding(10, remaining=5))
    assert d.admitted
    assert d.prediction.predicted_tbt_ms == pytest.approx(60.0)
    # `early` looks at the load now and rejects it.
    assert decide(admission("early"), prompt=2000, obj=objective(ttft_ms=5000),
                  decode=decoding(10, remaining=5)).reason is Reason.TBT


def test_requests_that_finish_prefill_before_arrival_count() -> None:
    """Nothing decodes now, but 10 requests join in 1 s, before this one's 2 s prefill ends."""
    d = decide(admission(), prompt=2000, obj=objective(ttft_ms=5000), decode=decoding(10, joins_in_s=1.0))
    assert d.reason is Reason.TBT
    assert decide(admission("early"), prompt=2000, obj=objective(ttft_ms=5000),
                  decode=decoding(10, joins_in_s=1.0)).admitted


def test_requests_joining_later_in_its_stay_count_too() -> None:
    """They join 0.1 s after it arrives, while it still decodes (100 tokens x 60 ms)."""
    d = decide(admission(), prompt=500, max_tokens=100, decode=decoding(10, joins_in_s=0.6))
    assert d.reason is Reason.TBT
    assert d.prediction.predicted_tbt_ms == pytest.approx(160.0)


def test_none_admits_what_predictive_rejects() -> None:
    assert decide(admission("none"), prefill=queued(800.0, 900.0), decode=decoding(10)).admitted


def test_queue_threshold_counts_requests() -> None:
    assert decide(admission("queue-threshold", queue_threshold=2), prefill=queued(1, 1)).reason is Reason.QUEUE_THRESHOLD
    assert decide(admission("queue-threshold", queue_threshold=3), prefill=queued(1, 1)).admitted


@pytest.mark.parametrize("policy", [p.value for p in Policy])
def test_every_policy_bounds_the_queue_and_the_kv(policy: str) -> None:
    d = decide(admission(policy, max_queue_per_worker=2), prefill=queued(1, 1))
    assert d.reason is Reason.QUEUE_FULL
    assert isinstance(d.error(), OverloadedError) and status_of(d.error()).http == 429
    full = DecodeLedger(total_blocks=40)
    assert decide(admission(policy), prompt=500, max_tokens=200, decode=full).reason is Reason.KV_CAPACITY


def test_a_class_without_objectives_is_shed_first() -> None:
    batch = resolve(AdmissionConfig(), "batch", Slo())
    assert not batch.has_slo
    assert decide(admission(), obj=batch).admitted
    # 7 running: 50 + 80 = 130 ms: a standard request (150 ms) still fits; batch needs 0.8 * 150 = 120.
    assert decide(admission(), decode=decoding(6)).admitted
    assert decide(admission(), obj=batch, decode=decoding(7)).reason is Reason.SHED
    assert decide(admission(), decode=decoding(7)).admitted


def test_a_higher_class_may_not_push_a_queued_request_past_its_deadline() -> None:
    ledger = PrefillLedger()
    ledger.add(PendingPrefill("head", 1, math.inf, 100.0, NOW))
    ledger.add(PendingPrefill("due", 1, NOW + 0.9, 500.0, NOW))  # ends at 600 ms, first token ~660
    urgent = resolve(AdmissionConfig(), "interactive", Slo())
    d = decide(admission(), prompt=300, obj=urgent, prefill=ledger)  # served before "due": +300 ms
    assert d.reason is Reason.DEADLINE


def test_colocated_prefill_stretches_the_running_steps() -> None:
    """Co-located, each chunk of a prefill (up to 512 tokens here, 1 ms a token) rides a step of
    the requests decoding (70 ms for two): their TBT is the mean of their longest tenth of gaps,
    so what counts is how many stretched steps fall in it."""
    adm = Admission(AdmissionConfig(), COST, colocated_chunk=512)
    long_outputs, short_outputs = decoding(2, remaining=100, tbt_slo_ms=150.0), decoding(2, remaining=5, tbt_slo_ms=150.0)
    patient = objective(ttft_ms=10_000.0)

    def decide_colocated(prompt: int, new: int, decode: DecodeLedger):
        c = adm.candidate(patient, prompt, 20, COST.est_prefill_ms(new), BS, NOW, new_tokens=new)
        return adm.decide(c, PrefillLedger(), decode, NOW)

    # 99 gaps: the longest 9 hold one 570 ms step and eight of 70 ms: 126 ms.
    assert decide_colocated(500, 500, long_outputs).admitted
    # Four chunks of 512 (582 ms steps): (4 x 582 + 5 x 70) / 9 = 297 ms.
    d = decide_colocated(2000, 2000, long_outputs)
    assert d.reason is Reason.TBT and "stretch" in d.detail
    # Four gaps: the TBT is the longest gap, the stretched step itself.
    assert decide_colocated(500, 500, short_outputs).reason is Reason.TBT
    # A cached prompt computes 16 tokens: 86 ms.
    assert decide_colocated(500, 16, short_outputs).admitted


def test_colocated_stretch_counts_the_chunks_queued_before_it() -> None:
    """One chunk alone fits the long decodes' tenth of gaps (126 ms, as above); behind three
    queued prefills of two chunks each, seven stretched steps land in it: (7 x 570 + 2 x 70) / 9."""
    adm = Admission(AdmissionConfig(), COST, colocated_chunk=512)
    patient = objective(ttft_ms=100_000.0)
    c = adm.candidate(patient, 500, 20, COST.est_prefill_ms(500), BS, NOW, new_tokens=500)
    queue = PrefillLedger()
    for i in range(3):
        queue.add(PendingPrefill(f"q{i}", 1, math.inf, 1000.0, NOW, chunks=2))
    alone = adm.decide(c, PrefillLedger(), decoding(2, remaining=100, tbt_slo_ms=150.0), NOW)
    behind = adm.decide(c, queue, decoding(2, remaining=100, tbt_slo_ms=150.0), NOW)
    assert alone.admitted
    assert behind.reason is Reason.TBT and "stretch" in behind.detail


def test_colocated_stretch_counts_requests_still_in_prefill_ahead_of_it() -> None:
    """A request admitted but still in prefill decodes by the time the candidate's chunks run:
    they stretch its steps too (admission run 9: a cold prompt's TBT went to 0.7 s when the next
    cold prompt's chunks ran beside its decode, both admitted)."""
    adm = Admission(AdmissionConfig(), COST, colocated_chunk=512)
    patient = objective(ttft_ms=100_000.0)
    c = adm.candidate(patient, 2000, 20, COST.est_prefill_ms(2000), BS, NOW, new_tokens=2000)
    ahead = decoding(2, remaining=100, joins_in_s=3.0, tbt_slo_ms=150.0)  # both still in prefill
    d = adm.decide(c, PrefillLedger(), ahead, NOW)
    assert d.reason is Reason.TBT and "stretch" in d.detail  # four 582 ms steps in their tenth: 297 ms
    no_objective = decoding(2, remaining=100, joins_in_s=3.0)
    assert adm.decide(c, PrefillLedger(), no_objective, NOW).admitted


# ---------------------------------------------------------------------- classes and config


def test_classes_resolve_with_overrides() -> None:
    cfg = AdmissionConfig(standard_ttft_ms=3000, standard_tbt_ms=200)
    assert resolve(cfg, None, Slo()) == Objective(cfg.classes()["standard"], 3000, 200)
    assert resolve(cfg, None, Slo(tbt_ms=50)) == Objective(cfg.classes()["standard"], 3000, 50, False, True)
    assert resolve(cfg, "standard", Slo(ttft_ms=500)).ttft_ms == 500
    assert resolve(cfg, "interactive", Slo()).rank > resolve(cfg, "batch", Slo()).rank
    with pytest.raises(InvalidRequestError) as e:
        resolve(cfg, "gold", Slo())
    assert e.value.field == "priority_class"


@pytest.mark.parametrize("bad", [{"admission": "maybe"}, {"default_class": "gold"}, {"standard_ttft_ms": -1},
                                 {"queue_threshold": 0}, {"batch_tbt_ms": math.inf}])
def test_bad_config_is_a_clear_error(bad: dict) -> None:
    with pytest.raises(ConfigError):
        AdmissionConfig(**bad)


def test_output_estimate_follows_what_the_class_generates() -> None:
    est = OutputEstimator()
    assert est.expected("standard", 100) == 100  # nothing seen: max_tokens
    for _ in range(50):
        est.observe("standard", 20, 100)
    assert 20 <= est.expected("standard", 100) <= 25
    assert est.expected("batch", 100) == 100


# ---------------------------------------------------------------------- ledgers and measuring


def test_the_prefill_queue_is_served_by_rank_then_deadline() -> None:
    ledger = PrefillLedger()
    ledger.add(PendingPrefill("a", 1, math.inf, 100.0, NOW - 0.04))  # head: 40 ms done
    ledger.add(PendingPrefill("b", 0, math.inf, 200.0, NOW))
    ledger.add(PendingPrefill("c", 1, NOW + 5, 300.0, NOW))
    plan = ledger.plan(NOW)
    assert [s.job.request_id for s in plan] == ["a", "c", "b"]
    assert plan[0].end_ms == pytest.approx(60.0)
    assert ledger.wait_ms(1, NOW) == pytest.approx(60 + 300)  # "b" is served after it
    assert ledger.wait_ms(0, NOW) == pytest.approx(60 + 300 + 200)
    ledger.finish("a", NOW)
    assert ledger.depth == 2 and ledger.plan(NOW)[0].job.request_id == "c"


def test_the_decode_ledger_books_exactly() -> None:
    ledger = DecodeLedger(total_blocks=100)
    ledger.book(BoundRequest("x", 100, 10, math.inf, NOW, 30))
    with pytest.raises(KeyError):
        ledger.book(BoundRequest("x", 100, 10, math.inf, NOW, 30))
    assert ledger.free_blocks == 70
    ledger.check_integrity()
    ledger.release("x")
    ledger.release("x")  # idempotent
    assert ledger.free_blocks == 100 and ledger.reserved_blocks == 0
    ledger.check_integrity()


def test_peak_reports_the_tightest_moment() -> None:
    pred = DecodeLoadPredictor(COST)
    jobs = [DecodeJob(300.0, 100, 50, tbt_slo_ms=90.0)]
    load = pred.peak(jobs, arrival_ms=100.0, prompt_len=10, output_tokens=10)
    assert (load.batch, load.limit_ms, load.at_ms) == (2, 90.0, 300.0)


def test_top_gaps_is_the_bench_tbt() -> None:
    gaps = TopGaps(max_tokens=21)  # 20 gaps: the longest 2
    t = 0.0
    for gap in [0.1] * 17 + [0.5, 0.3, 0.2]:
        gaps.tick(t)
        t += gap
    gaps.tick(t)
    assert gaps.mean_s() == pytest.approx((0.5 + 0.3) / 2)
    assert TopGaps(5).mean_s() is None


def test_error_histogram_is_cumulative() -> None:
    stats = AdmissionStats()
    stats.measured(1000.0, 0.9, 100.0, 0.2)  # +0.1 s, -0.1 s
    stats.measured(1000.0, 1.0, 100.0, None)
    assert stats.ttft_error.count == 2 and stats.tbt_error.count == 1
    h = Histogram()
    for v in (-20.0, 0.0, 0.05, 20.0):
        h.observe(v)
    cumulative = dict(h.cumulative())
    assert cumulative[-10.0] == 1 and cumulative[0.0] == 2 and cumulative[0.05] == 3 and h.count == 4


def test_objectives_the_hardware_cannot_meet_idle_admit_one_at_a_time() -> None:
    """A 40 ms TBT objective on hardware whose lone step is 60 ms, or a 100 ms TTFT for a 500 ms
    prefill: an idle worker admits the request (the miss is not load's), a busy one rejects it."""
    tight = objective(tbt_ms=40.0)
    assert decide(admission(), obj=tight).admitted
    assert decide(admission(), obj=tight, decode=decoding(1)).reason is Reason.TBT
    assert decide(admission(), obj=objective(ttft_ms=100.0)).admitted
    assert decide(admission(), obj=objective(ttft_ms=100.0), prefill=queued(50.0)).reason is Reason.TTFT
    own = resolve(AdmissionConfig(), None, Slo(tbt_ms=40.0))  # the request's own: fail fast
    assert own.own_tbt and decide(admission(), obj=own).reason is Reason.TBT


def test_predictions_are_calibrated_by_what_requests_measured() -> None:
    adm = admission()
    clock = [0.0]
    adm.calibration = Calibration(clock=lambda: clock[0])
    first = decide(adm)
    assert first.prediction.predicted_ttft_ms == pytest.approx(560.0)  # nothing measured: the model's
    adm.observe(first, ttft_s=5.6, tbt_s=0.6)  # a fresh server's outlier: 10x
    for _ in range(2):
        adm.observe(first, ttft_s=0.84, tbt_s=0.09)  # 1.5x
    d = decide(adm)
    assert d.prediction.predicted_ttft_ms == pytest.approx(840.0)  # the median, not the outlier
    assert d.prediction.predicted_tbt_ms == pytest.approx(90.0)
    assert (d.raw_ttft_ms, d.raw_tbt_ms) == (pytest.approx(560.0), pytest.approx(60.0))
    for _ in range(3):
        adm.observe(d, ttft_s=5.6, tbt_s=None)
    assert adm.calibration.ttft.scale == Calibration.HIGH  # clamped
    clock[0] += Calibration.WINDOW_S + 1  # nothing measured for a while: the factor expires
    assert adm.calibration.ttft == IDENTITY and adm.calibration.tbt == IDENTITY


def test_the_admission_test_uses_a_high_quantile_of_past_errors_and_reports_the_median() -> None:
    """Half of the requests predicted right at their SLO measure over it: the test scales the
    (median-calibrated) prediction by the admit quantile's ratio to the median."""
    adm = admission(admit_quantile=0.9)
    base = decide(adm)
    for n, ratio in enumerate((1.0,) * 8 + (1.5, 1.5)):  # the slowest tenth measured 1.5x the median
        raw_tbt = 60.0 if n % 2 else 120.0  # TBT seen up to 120 ms: a 100 ms one is inside the fit
        adm.calibration.observe(base.raw_ttft_ms, 560.0 * ratio, raw_tbt, raw_tbt * ratio)
    assert adm.calibration.ttft.guard == pytest.approx(1.5) and adm.calibration.tbt.guard == pytest.approx(1.5)
    # TTFT 560 ms x 1.5 = 840 ms: within 1 s, not within 800 ms; reported at the median, 560 ms.
    assert decide(adm, obj=objective(ttft_ms=1000.0)).admitted
    d = decide(adm, obj=objective(ttft_ms=800.0), prefill=queued(1.0))
    assert d.reason is Reason.TTFT and d.prediction.predicted_ttft_ms == pytest.approx(561.0)
    assert "p90" in d.detail
    # TBT: a batch of 4 steps at 90 ms (x 1.5 = 135 ms), of 5 at 100 ms (150 ms).
    assert decide(adm, obj=objective(tbt_ms=140.0), decode=decoding(3)).admitted
    assert decide(adm, obj=objective(tbt_ms=140.0), decode=decoding(4)).reason is Reason.TBT
    with pytest.raises(ConfigError, match="admit_quantile"):
        AdmissionConfig(admit_quantile=1.0)


def test_no_guard_from_a_handful_of_samples() -> None:
    """The p90 of four samples is their worst: live, one slow first request of four set a 1.54x
    guard that refused every later request, and none was admitted to correct it. Under
    MIN_FIT_SAMPLES the guard is 1; from there on, the quantile's."""
    few = [(1000.0, 1000.0 * r) for r in (0.87, 0.74, 0.91, 1.37)]
    assert fit_samples(few, 0.9).guard == 1.0
    many = [(1000.0, 1000.0 * r) for r in (1.0,) * (Calibration.MIN_FIT_SAMPLES - 1) + (1.5,)]
    assert fit_samples(many, 0.9).guard == pytest.approx(1.5)


def test_a_constant_overhead_is_fitted_as_an_offset_not_a_ratio() -> None:
    """Requests pay ~200 ms beyond the engine's time whatever their length (RPCs, handoff,
    streaming): a ratio would over-scale a cold 3 s prefill and under-scale a warm 400 ms one."""
    samples = [(raw, raw + 200.0) for raw in (400.0, 500.0, 800.0, 1200.0, 2000.0, 2500.0, 3000.0, 3500.0)]
    samples.append((600.0, 5000.0))  # one outlier changes nothing
    fit = fit_samples(samples, 0.5)
    assert (fit.offset_ms, fit.scale) == (pytest.approx(200.0), pytest.approx(1.0))
    assert fit(400.0) == pytest.approx(600.0) and fit(3000.0) == pytest.approx(3200.0)
    # Fewer than MIN_FIT_SAMPLES, or predictions all alike: the median ratio, no offset.
    assert fit_samples(samples[:3], 0.5) == Fit(0.0, pytest.approx(1.4), pytest.approx(1.0))
    alike = fit_samples([(500.0, 600.0)] * 9 + [(520.0, 650.0)], 0.5)
    assert alike.offset_ms == 0.0 and alike.scale == pytest.approx(1.2)
    # A line through the origin's wrong side (measured under predicted by a constant) is no
    # overhead: a ratio instead.
    under = fit_samples([(raw, raw - 100.0) for raw in (400.0, 800.0, 1600.0, 2400.0, 3200.0, 3600.0, 4000.0, 4400.0)],
                        0.5)
    assert under.offset_ms == 0.0 and under.scale < 1.0


def test_admission_uses_the_fitted_line_and_refits_only_on_new_samples() -> None:
    now = [100.0]
    adm = Admission(AdmissionConfig(), COST, clock=lambda: now[0])
    raws = (400.0, 500.0, 800.0, 1200.0, 2000.0, 2500.0, 3000.0, 3500.0)
    for raw in raws:
        adm.calibration.observe(raw, raw + 200.0, raw / 10, raw / 10 + 20.0)
    d = decide(adm)  # raw: TTFT 560 ms (500 prefill + a 60 ms step), TBT 60 ms
    assert d.prediction.predicted_ttft_ms == pytest.approx(760.0)
    assert d.prediction.predicted_tbt_ms == pytest.approx(80.0)
    assert d.joins_in_ms == pytest.approx(760.0 - 60.0)  # the first step scaled, not offset
    fit = adm.calibration.ttft
    assert adm.calibration.ttft is fit  # cached while the window is unchanged
    adm.calibration.observe(560.0, 900.0, 60.0, 80.0)
    assert adm.calibration.ttft is fit  # a settled fit is redone at most every REFIT_S
    now[0] += Calibration.REFIT_S
    assert adm.calibration.ttft is not fit


def test_tokens_per_step_follows_the_workers_recent_steps() -> None:
    """Windows of >= 32 new request-steps move the estimate halfway to their TBT divisor: a
    worker that speculated at low load and stops at high load is soon predicted at ~1."""
    from halfmoon.conductor.ledger import tbt_tokens_per_step

    ledger = DecodeLedger(total_blocks=8)
    ledger.observe_decode(20, 60, 0)  # too few steps yet
    assert ledger.tokens_per_step == 1.0
    ledger.observe_decode(40, 120, 0)  # 3 tokens every step: the tail counts chunks as 2 tokens
    assert ledger.tokens_per_step == pytest.approx(1.5)
    ledger.observe_decode(80, 240, 0)
    assert ledger.tokens_per_step == pytest.approx(1.75)
    for n in range(1, 6):  # speculation off: one token a step
        ledger.observe_decode(80 + 40 * n, 240 + 40 * n, 40 * n)
    assert ledger.tokens_per_step == pytest.approx(1.0 + 0.75 / 32)
    ledger.observe_decode(10, 10, 10)  # the worker restarted: its counters start over
    ledger.observe_decode(50, 50, 50)
    assert ledger.tokens_per_step == pytest.approx(1.0 + 0.75 / 64)
    assert tbt_tokens_per_step(1.0, 1.0) == 1.0 and tbt_tokens_per_step(6.0, 0.0) == 2.0
    assert tbt_tokens_per_step(3.0, 0.3) == 1.0  # one-token steps' gaps fill the longest tenth
    # one-token steps' gaps half of the longest tenth, the rest chunks of 2: 1 / (0.5 + 0.5 / 2)
    assert tbt_tokens_per_step(3.0, 0.15) == pytest.approx(4 / 3)
    assert tbt_tokens_per_step(0.5, 0.0) == 1.0  # a mean below one is read as one


def test_joining_a_decoding_batch_waits_half_a_step_in_progress_on_average() -> None:
    """Alone, the first token rides the first step; joining a batch that decodes, the request
    first waits out the step in progress (half of one on average: issue 38, bursty seed 0)."""
    alone = decide(admission())
    joined = decide(admission(), prompt=500, obj=objective(ttft_ms=5000), decode=decoding(2))
    step = COST.est_decode_step_ms(3, 2 * 100 + 500)  # the batch it joins, itself included
    assert alone.prediction.predicted_ttft_ms == pytest.approx(500 + 60)
    assert joined.prediction.predicted_ttft_ms == pytest.approx(500 + 1.5 * step)
    assert joined.joins_in_ms == pytest.approx(500)  # its prefill's end: the wait is after it


def test_a_fit_learned_on_short_prompts_adds_beyond_them_and_does_not_lock_out_long_ones() -> None:
    """Issue 49, live: chat (predicted ~50 ms, measured ~4x: a constant overhead) set the ratio
    and the guard at their caps; a 1.5 s document prefill then calibrated to 3 s x 2 and every
    document of the next phase was refused, measuring nothing to correct it. Beyond the largest
    prediction fitted, the fit and its guard add what they learned at that edge."""
    chat = [(50.0 + i, 200.0 + (150.0 if i % 5 == 0 else 0.0)) for i in range(10)]
    fit = fit_samples(chat, 0.9, adds_beyond=True)
    assert fit.scale == Calibration.HIGH and fit.guard > 1.2 and fit.hi_ms == pytest.approx(59.0)
    assert fit(55.0) == pytest.approx(110.0)  # inside: the ratio, as before
    edge = fit(fit.hi_ms)
    assert fit(1500.0) == pytest.approx(edge + 1500.0 - fit.hi_ms)  # beyond: the profile's slope
    assert fit.guarded(fit(55.0)) == pytest.approx(110.0 * fit.guard)
    assert fit.guarded(fit(1500.0)) == pytest.approx(fit(1500.0) + (fit.guard - 1.0) * edge)
    # A fit that measured faster than predicted keeps its own (smaller) slope beyond the edge.
    fast = fit_samples([(100.0, 70.0)] * 10, 0.5, adds_beyond=True)
    assert fast(1000.0) == pytest.approx(700.0)
    # Admission: a prompt predicted at 560 ms (10x the chat range) is admitted under 1 s; multiplied
    # by the chat ratio and guard (1120 ms x guard) it was refused.
    adm = admission()
    chat_decision = decide(adm)
    for raw, measured in chat:
        adm.calibration.observe(raw, measured, 60.0, 60.0)
    doc = decide(adm, obj=objective(ttft_ms=1000.0))
    assert doc.admitted and chat_decision.raw_ttft_ms > fit.hi_ms


def test_the_guard_is_that_of_the_predictions_nearest_the_request() -> None:
    """Issue 49, live: after a mix shift one window held chat (50 ms predicted, measured 2-4x
    under CPU contention) and documents (2 s, within 10%); one guard of both (1.75-1.97x) refused
    the next phase's documents. Each is guarded by the errors of its own neighbours."""
    rng = random.Random(5)
    chat = [(50.0 + rng.random() * 10, (50.0 + rng.random() * 10) * rng.choice((2.0, 2.2, 2.5, 3.5, 4.0)))
            for _ in range(40)]
    docs = [(2000.0 + rng.random() * 400, 2000.0 * rng.uniform(1.0, 1.1)) for _ in range(24)]
    fit = fit_samples(chat + docs, 0.9, adds_beyond=True)
    assert fit.guard > 1.3  # the window's, what one guard of both made
    doc = fit(2200.0)
    assert fit.guarded(doc) < 1.15 * doc  # its neighbours are documents
    assert fit.guarded(fit(55.0)) > 1.3 * fit(55.0)  # chat keeps its own wide guard
    plain = fit_samples(chat + docs, 0.9)  # without: one guard for all
    assert plain.guarded(plain(2200.0)) == pytest.approx(plain.guard * plain(2200.0))


def test_a_window_of_chat_and_documents_calibrates_each_by_its_own() -> None:
    """The live 2P2D window at the second documents phase (issue 49): chat predicted ~190 ms
    measured ~505 ms (2.7x: CPU contention the profile never saw), documents predicted ~1.5 s
    measured ~0.95 s (0.63x). No sane line runs through both (a slope of 0.34), so the plain fit
    is the median ratio, chat's, capped at 2x: documents at 3 s, every one refused at 3 s. Each
    prediction is corrected by its neighbours' ratio instead."""
    rng = random.Random(7)
    chat = [(rng.uniform(170.0, 210.0), rng.uniform(420.0, 600.0)) for _ in range(40)]
    docs = [(rng.uniform(1300.0, 1700.0), rng.uniform(850.0, 1100.0)) for _ in range(20)]
    plain = fit_samples(chat + docs, 0.9)
    assert plain.scale == Calibration.HIGH and plain(1500.0) == pytest.approx(3000.0)
    fit = fit_samples(chat + docs, 0.9, adds_beyond=True)
    assert 850.0 < fit(1500.0) < 1100.0 and 420.0 < fit(190.0) < 600.0
    assert fit.guarded(fit(1500.0)) < 1500.0  # a document is admitted well within 3 s
    adm = admission()
    for raw, measured in chat + docs:
        adm.calibration.observe(raw, measured, 60.0, 60.0)
    assert 850.0 < adm.calibration.ttft(1500.0) < 1100.0


def _contended(now: list[float]) -> Admission:
    """TBT measured 2-8x the profile's 60 ms (the live 1P3D chat phase: three decode workers and
    a prefill worker on two cores), so a 250 ms objective refuses a request on idle workers."""
    adm = Admission(AdmissionConfig(), COST, clock=lambda: now[0])
    rng = random.Random(5)
    for _ in range(40):
        adm.calibration.observe(560.0, 600.0, 60.0, rng.uniform(120.0, 480.0))
    return adm


def test_a_fit_that_refused_everything_for_stale_s_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    """Refused requests measure nothing: without this, the fit would refuse for its whole window
    (live: a chat phase of 80 s, issue 49). After STALE_S with nothing admitted nor measured,
    requests are priced by the profile again."""
    now = [100.0]
    adm, obj = _contended(now), resolve(AdmissionConfig(), "standard", Slo(ttft_ms=2000.0, tbt_ms=250.0))
    assert decide(adm, obj=obj).reason is Reason.TBT
    now[0] += Calibration.STALE_S - 1.0
    assert decide(adm, obj=obj).reason is Reason.TBT  # not stale yet
    now[0] += 2.0
    with caplog.at_level("WARNING", logger="halfmoon.conductor.calibration"):
        d = decide(adm, obj=obj)
    assert d.admitted and d.prediction.predicted_tbt_ms == pytest.approx(60.0)
    assert "(2 requests refused): the TBT calibration (x2.00" in caplog.text and "dropped" in caplog.text
    for _ in range(Calibration.MIN_SAMPLES):  # what admitted requests measure starts the next fit
        adm.calibration.observe(560.0, 600.0, 60.0, 420.0)
    assert adm.calibration.tbt(60.0) > 60.0


def test_a_fit_is_kept_while_requests_are_admitted() -> None:
    """Admitted requests will measure: a quiet spell of samples (long generations) is no lock-out."""
    now = [100.0]
    adm, obj = _contended(now), resolve(AdmissionConfig(), "standard", Slo(ttft_ms=2000.0, tbt_ms=250.0))
    now[0] += Calibration.STALE_S - 5.0
    adm.calibration.admitted()
    now[0] += 10.0
    assert decide(adm, obj=obj).reason is Reason.TBT


def test_a_quiet_spell_drops_the_fit_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """No traffic for STALE_S is no lock-out: the fit is dropped all the same (the load it learned
    is gone), but only a refusing one is worth an operator's attention."""
    now = [100.0]
    adm, obj = _contended(now), resolve(AdmissionConfig(), "standard", Slo(ttft_ms=2000.0, tbt_ms=250.0))
    now[0] += Calibration.STALE_S + 1.0
    with caplog.at_level("DEBUG", logger="halfmoon.conductor.calibration"):
        assert decide(adm, obj=obj).admitted
    assert [r.levelname for r in caplog.records] == ["DEBUG", "DEBUG"]  # TTFT's and TBT's
