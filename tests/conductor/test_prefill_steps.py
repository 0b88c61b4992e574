"""A prefill worker packs its queue into steps of several prompts (conductor/prefill_steps.py):
the step's time, the packing, the ledger's time line of a batched queue, and admission pricing
it (issue 38: a live burst's first tokens came together, a step later than one-at-a-time
predicted), with the per-request overhead and the window's order."""

from __future__ import annotations

import math

import pytest

from halfmoon.conductor.admission import Admission, AdmissionConfig, resolve
from halfmoon.conductor.backend import Slo
from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.dispatch import Ask, DecodeSide, Dispatcher, PrefillSide, PrefixMatch
from halfmoon.conductor.ledger import DecodeLedger, PendingPrefill, PrefillLedger
from halfmoon.conductor.prefill_steps import PrefillSteps, pack

NOW = 1000.0
# prefill: 10 ms a step + 1 ms per new token; decode step: 50 ms + 10 ms per request
COST = CostModel((10.0, 1.0, 0.0, 0.0), (50.0, 10.0, 0.0), 1e9, 1, "test")
STEPS = PrefillSteps(COST, 512)


def job(rid: str, tokens: int, sent_at: float = NOW, deadline: float = math.inf) -> PendingPrefill:
    return PendingPrefill(rid, 1, deadline, COST.est_prefill_ms(tokens), sent_at, new_tokens=tokens)


def batched(*jobs: PendingPrefill) -> PrefillLedger:
    """A ledger of jobs sent in this order (the first found the worker idle: its step alone)."""
    ledger = PrefillLedger(steps=STEPS)
    for j in jobs:
        ledger.add(j)
    return ledger


def test_a_step_of_several_chunks_pays_the_constant_once() -> None:
    assert COST.est_prefill_step_ms([(100, 0)]) == pytest.approx(COST.est_prefill_ms(100))
    assert COST.est_prefill_step_ms([(100, 0), (200, 0)]) == pytest.approx(10 + 300)
    assert COST.est_prefill_step_ms([]) == 0.0 and COST.est_prefill_step_ms([(0, 5)]) == 0.0
    attention = CostModel((0.0, 0.0, 1.0, 0.0), (1.0, 0.0, 0.0), 1e9, 1)
    assert attention.est_prefill_step_ms([(10, 512)]) == pytest.approx(attention.est_prefill_ms(10, 512))


def test_the_overhead_travels_with_the_cost_model_json() -> None:
    measured = CostModel(COST.prefill_coef, COST.decode_coef, 1e9, 1, "t", overhead_ms=180.0)
    assert CostModel.from_json(measured.to_json()).overhead_ms == 180.0
    assert "overhead_ms" not in COST.to_json() and CostModel.from_json(COST.to_json()).overhead_ms == 0.0


def test_pack_takes_the_queue_in_order_while_the_budget_lasts() -> None:
    assert pack([112, 114, 135, 175, 135], 512) == [112, 114, 135, 151]
    assert pack([600, 100], 512) == [512]  # a long prompt fills the step: a chunk
    assert pack(iter([100]), 512) == [100]


def test_a_burst_in_one_step_gets_its_first_tokens_together() -> None:
    times = STEPS.lay_out([], [job("a", 100), job("b", 200), job("c", 300)], 0.0)
    step1 = 10 + 100 + 200 + 212  # c's first 212 tokens ride the first step
    assert times["a"] == times["b"] == pytest.approx((0.0, step1))
    assert times["c"] == pytest.approx((0.0, step1 + 10 + 88))  # its last chunk leads the next step


def test_the_ledger_lays_out_the_step_in_progress_then_the_queue() -> None:
    ledger = batched(job("a", 100), job("b", 100), job("c", 200))  # a window's decisions, same instant
    assert ledger.in_step == {"a": 100}  # the engine stepped as soon as "a" arrived
    plan = {s.job.request_id: s.end_ms for s in ledger.plan(NOW + 0.05)}
    assert plan == pytest.approx({"a": 110 - 50, "b": 60 + 310, "c": 60 + 310})  # b and c: one step
    ledger.finish("a", NOW + 0.1)  # the step ended: the next takes the queue as it stands
    assert ledger.in_step == {"b": 100, "c": 200} and ledger.head_started == NOW + 0.1
    ledger.finish("b", NOW + 0.45)  # b's step ended: c is computed, waiting for its own finish
    assert ledger.in_step == {} and ledger.head is None
    assert [s.end_ms for s in ledger.plan(NOW + 0.45)] == [0.0]
    ledger.finish("c", NOW + 0.46)
    assert ledger.depth == 0


def test_a_chunked_prompt_goes_on_in_the_next_step() -> None:
    ledger = batched(job("long", 700), job("b", 100, sent_at=NOW + 0.1))
    assert ledger.in_step == {"long": 512}
    ledger.finish("other", NOW)  # not its own: nothing
    assert ledger.in_step == {"long": 512}
    plan = {s.job.request_id: s.end_ms for s in ledger.plan(NOW)}
    assert plan == pytest.approx({"long": 522 + 10 + 188 + 100, "b": 522 + 10 + 188 + 100})


def test_a_queue_kept_before_the_steps_were_known_is_a_step_in_progress() -> None:
    ledger = PrefillLedger()
    ledger.add(PendingPrefill("hold", 0, math.inf, 1e6, NOW))  # no size known: a step of its cost
    ledger.use(STEPS)
    assert ledger.in_step == {"hold": 512} and ledger.head_started == NOW
    assert ledger.end_ms(job("x", 50), NOW) == pytest.approx(1e6 + 60)


def test_a_candidate_joins_the_step_after_the_one_in_progress() -> None:
    ledger = batched(job("a", 100))
    assert ledger.end_ms(job("x", 50), NOW + 0.01) == pytest.approx(110 + 60 - 10)
    assert PrefillLedger(steps=STEPS).end_ms(job("x", 50), NOW) == pytest.approx(60)  # idle: at once
    assert ledger.wait_ms(1, NOW + 0.01) == pytest.approx(100)


def test_pushed_past_deadline_sees_the_steps() -> None:
    ledger = batched(job("a", 100))
    ledger.add(job("due", 100, sent_at=NOW + 0.05, deadline=NOW + 0.35))  # alone: ends at 220 ms
    assert ledger.pushed_past_deadline(job("x", 20), NOW + 0.05, 50.0) is None  # its step: 240 ms
    # queued behind "due", it still rides its step (to 420 ms): due's first token at 470 > 350 ms
    assert ledger.pushed_past_deadline(job("x", 200), NOW + 0.05, 50.0).request_id == "due"


def test_admission_prices_the_batch_and_the_overhead() -> None:
    adm = Admission(AdmissionConfig(), COST)
    obj = resolve(AdmissionConfig(), None, Slo())
    c = adm.candidate(obj, 100, 20, COST.est_prefill_ms(100), 16, NOW)
    decode = DecodeLedger(total_blocks=1000)
    alone = adm.predict(c, PrefillLedger(steps=STEPS), decode, NOW)
    behind = adm.predict(c, batched(job("a", 300), job("b", 100)), decode, NOW + 0.01)
    assert alone.ttft_ms == pytest.approx(110 + 60)
    assert behind.ttft_ms == pytest.approx(410 - 10 + 110 + 60)  # the step of a and b, then its own
    slow = Admission(AdmissionConfig(), CostModel(COST.prefill_coef, COST.decode_coef, 1e9, 1, overhead_ms=200.0))
    assert slow.predict(c, PrefillLedger(steps=STEPS), decode, NOW).ttft_ms == pytest.approx(110 + 200 + 60)


def test_a_window_is_served_in_the_order_it_decided() -> None:
    """Arrivals microseconds apart (deadlines in arrival order) decided together, shortest first:
    the queue (and the engine, given the booking's deadline) serves the window's order."""
    dispatcher = Dispatcher(AdmissionConfig(), COST, 16, prefill_budget=512)
    prefill = [PrefillSide("p0", PrefillLedger())]
    decode = [DecodeSide("d0", DecodeLedger(total_blocks=10_000))]
    first = dispatcher.dispatch(Ask("first", 40, 4), PrefixMatch(), prefill, decode, NOW)  # keeps it busy
    # "long" arrived first; the window decides "short" first (shortest prefill first)
    short = dispatcher.dispatch(Ask("short", 40, 4), PrefixMatch(), prefill, decode, NOW + 0.02, arrival=NOW + 0.002)
    long_ = dispatcher.dispatch(Ask("long", 400, 4), PrefixMatch(), prefill, decode, NOW + 0.0201,
                                arrival=NOW + 0.001)
    assert prefill[0].ledger.steps is dispatcher.prefill_steps
    assert first.deadline < short.deadline < long_.deadline  # queued in the order decided
    assert long_.candidate.deadline < short.candidate.deadline  # its TTFT deadline stays its arrival's
    order = [j.request_id for j in sorted(prefill[0].ledger.jobs.values(), key=PendingPrefill.order)]
    assert order == ["first", "short", "long"]


def test_a_long_prompt_alone_is_its_chunks_steps() -> None:
    from halfmoon.conductor.prefill_steps import chunked_prefill_ms

    attention = CostModel((10.0, 1.0, 0.01, 0.0), (50.0, 0.0, 0.0), 1e9, 1)
    assert chunked_prefill_ms(attention, 300, 0, 512) == pytest.approx(attention.est_prefill_ms(300))
    # 700 tokens: 512 alone, then 188 attending to the first 512 as to a cached prefix
    assert chunked_prefill_ms(attention, 700, 0, 512) == pytest.approx(
        attention.est_prefill_ms(512) + attention.est_prefill_ms(188, 512))
    assert STEPS.alone_ms(700, 0) == pytest.approx(10 + 512 + 10 + 188)
    dispatcher = Dispatcher(AdmissionConfig(standard_ttft_ms=60_000), COST, 16, prefill_budget=512)
    booking = dispatcher.dispatch(Ask("long", 700, 4), PrefixMatch(), [PrefillSide("p0", PrefillLedger())],
                                  [DecodeSide("d0", DecodeLedger(total_blocks=10_000))], NOW)
    assert booking.candidate.prefill_ms == pytest.approx(720.0)
