"""The one decision path (conductor/dispatch.py): route, admit, book; nothing booked on a
rejection; co-located prefills priced with the decode steps their chunks share."""

from __future__ import annotations

import pytest

from halfmoon.conductor.admission import AdmissionConfig
from halfmoon.conductor.backend import Slo
from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.dispatch import Ask, DecodeSide, Dispatcher, PrefillSide, PrefixMatch
from halfmoon.conductor.errors import OverloadedError
from halfmoon.conductor.ledger import BoundRequest, DecodeLedger, PrefillLedger

NOW = 1000.0
# prefill: 1 ms per new token; decode step: 50 ms + 10 ms per request in the batch.
COST = CostModel((0.0, 1.0, 0.0, 0.0), (50.0, 10.0, 0.0), 1e9, 1, "test")


def sides(n_prefill: int = 2, blocks: int = 1000) -> tuple[list[PrefillSide], list[DecodeSide]]:
    return ([PrefillSide(f"p{i}", PrefillLedger()) for i in range(n_prefill)],
            [DecodeSide("d0", DecodeLedger(total_blocks=blocks))])


def test_dispatch_routes_to_the_prefix_holder_and_books_both_ledgers() -> None:
    dispatcher = Dispatcher(AdmissionConfig(), COST, 16)
    prefill, decode = sides()
    prefix = PrefixMatch({"p1": 480}, 480, "p1")
    booking = dispatcher.dispatch(Ask("r1", 500, 20), prefix, prefill, decode, NOW)
    assert (booking.prefill_id, booking.decode_id, booking.prefix_tokens) == ("p1", "d0", 480)
    assert booking.candidate.prefill_ms == pytest.approx(20.0)  # 20 new tokens at 1 ms
    assert prefill[1].ledger.depth == 1 and prefill[0].ledger.depth == 0
    assert decode[0].ledger.jobs["r1"] is booking.bound and decode[0].ledger.reserved_blocks == 33
    assert dispatcher.stats.decisions == {("standard", "admitted", ""): 1}


def test_a_rejection_books_nothing() -> None:
    dispatcher = Dispatcher(AdmissionConfig(), COST, 16)
    prefill, decode = sides()
    with pytest.raises(OverloadedError) as e:  # 3 s of prefill against a 1 s objective
        dispatcher.dispatch(Ask("r1", 3000, 20, slo=Slo(ttft_ms=1000)), PrefixMatch(), prefill, decode, NOW)
    assert e.value.reason == "ttft"
    assert all(p.ledger.depth == 0 for p in prefill) and not decode[0].ledger.jobs
    assert dispatcher.stats.decisions == {("standard", "rejected", "ttft"): 1}


def test_no_decode_room_is_a_kv_capacity_rejection() -> None:
    dispatcher = Dispatcher(AdmissionConfig(), COST, 16)
    prefill, decode = sides(blocks=10)
    with pytest.raises(OverloadedError) as e:
        dispatcher.dispatch(Ask("r1", 500, 20), PrefixMatch(), prefill, decode, NOW)
    assert e.value.reason == "kv_capacity"


def test_a_co_located_prefill_shares_its_chunks_steps_with_the_running_batch() -> None:
    dispatcher = Dispatcher(AdmissionConfig(), COST, 16, colocated_chunk=256)
    pending, bound = PrefillLedger(), DecodeLedger(total_blocks=1000)
    for i in range(3):  # three requests decoding now: a 80 ms step
        bound.book(BoundRequest(f"d{i}", 100, 50, float("inf"), NOW - 1.0, 10))
    booking = dispatcher.dispatch_colocated(Ask("r1", 600, 20), 64, pending, bound, NOW)
    new = 600 - 64
    assert booking.candidate.prefill_ms == pytest.approx(new * 1.0 + 3 * 80.0)  # ceil(536 / 256) = 3 steps
    assert booking.prefix_tokens == 64 and pending.depth == 1 and "r1" in bound.jobs
    # co-located, the last chunk samples the first token: no decode step after it
    assert booking.decision.joins_in_ms == pytest.approx(booking.decision.prediction.predicted_ttft_ms)


def test_finished_feeds_the_calibration_and_the_output_estimate() -> None:
    dispatcher = Dispatcher(AdmissionConfig(), COST, 16, clock=lambda: NOW)
    prefill, decode = sides()
    for i in range(3):
        booking = dispatcher.dispatch(Ask(f"r{i}", 500, 20), PrefixMatch(), prefill, decode, NOW)
        dispatcher.finished(booking, 10, 20, ttft_s=2 * booking.decision.raw_ttft_ms / 1e3, tbt_s=None)
        prefill[0].ledger.finish(f"r{i}", NOW)
        prefill[1].ledger.finish(f"r{i}", NOW)
        decode[0].ledger.release(f"r{i}")
    assert dispatcher.admission.calibration.ttft.scale == pytest.approx(2.0)
    assert dispatcher.admission.outputs.expected("standard", 20) < 20  # they stopped at half


def test_a_stream_of_few_gaps_teaches_admission_nothing_of_tbt() -> None:
    """1P1D streams its first two tokens together: a 2-token stream's one gap is ~2 ms, which as a
    TBT sample would drag the calibration's scale to its floor."""
    dispatcher = Dispatcher(AdmissionConfig(), COST, 16, clock=lambda: NOW)
    prefill, decode = sides()
    for i, tokens in enumerate([2, 2, 2, 3, 5, 5, 5]):  # 1, 2 and 4 gaps
        booking = dispatcher.dispatch(Ask(f"r{i}", 500, 20), PrefixMatch(), prefill, decode, NOW)
        tbt_s = 0.002 if tokens < 5 else 2 * booking.decision.raw_tbt_ms / 1e3
        dispatcher.finished(booking, tokens, 20, ttft_s=booking.decision.raw_ttft_ms / 1e3, tbt_s=tbt_s)
        for side in prefill:
            side.ledger.finish(f"r{i}", NOW)
        decode[0].ledger.release(f"r{i}")
    assert dispatcher.admission.calibration.tbt.scale == pytest.approx(2.0)  # the three 4-gap streams only
