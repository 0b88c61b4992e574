"""The admission window (conductor/admission_window.py): arrivals held, then decided highest
class and shortest predicted prefill first; the held time counts in the TTFT predicted; a burst
decided so admits its short prompts where first come, first served admits its first ones; a
request refused only for its TTFT gets second looks as prefills end, and a last one when its
time to start runs out."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from halfmoon.conductor.admission import AdmissionConfig
from halfmoon.conductor.admission_window import AdmissionWindow, SecondLook
from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.dispatch import Ask, DecodeSide, Dispatcher, PrefillSide, PrefixMatch
from halfmoon.conductor.errors import OverloadedError
from halfmoon.conductor.ledger import DecodeLedger, PrefillLedger

NOW = 1000.0
# prefill: 1 ms per new token; decode step: 50 ms + 10 ms per request in the batch.
COST = CostModel((0.0, 1.0, 0.0, 0.0), (50.0, 10.0, 0.0), 1e9, 1, "test")


class Later:
    """What the window asked to run later, run when the test says (no clock)."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, Callable[[], None]]] = []

    def __call__(self, delay_s: float, fn: Callable[[], None]) -> None:
        self.calls.append((delay_s, fn))

    def run(self) -> None:
        calls, self.calls = self.calls, []
        for _, fn in calls:
            fn()


def test_a_zero_window_decides_at_once() -> None:
    later, order = Later(), []
    window = AdmissionWindow(0.0, later)
    window.hold(1, 500.0, lambda final: order.append(("a", final)))
    assert order == [("a", True)] and not later.calls and window.held == 0  # for good: no second look


def test_held_requests_are_decided_by_class_then_shortest_prefill_then_arrival() -> None:
    later, order = Later(), []
    window = AdmissionWindow(20.0, later)
    for name, rank, ms in [("long", 1, 600.0), ("short", 1, 100.0), ("urgent-long", 2, 900.0),
                           ("short-2", 1, 100.0), ("mid", 1, 300.0)]:
        window.hold(rank, ms, lambda final, n=name: order.append(n))
    assert order == [] and window.held == 5
    assert [d for d, _ in later.calls] == [pytest.approx(0.02)]  # one flush for the whole window
    later.run()
    assert order == ["urgent-long", "short", "short-2", "mid", "long"] and window.held == 0
    window.hold(1, 1.0, lambda final: order.append("next"))  # a new window opens with the next arrival
    assert len(later.calls) == 1


def test_a_negative_window_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        AdmissionWindow(-1.0, Later())


def burst(window_ms: float) -> tuple[list[str], list[str]]:
    """Six requests at one instant, the long ones first, through one Dispatcher on one 1P1D
    pair (TTFT 2 s): which are admitted, which refused (no second looks)."""
    dispatcher = Dispatcher(AdmissionConfig(admit_window_ms=window_ms, second_look=False), COST, 16)
    prefill, decode = [PrefillSide("p0", PrefillLedger())], [DecodeSide("d0", DecodeLedger(total_blocks=10_000))]
    later, admitted, refused = Later(), [], []
    window = AdmissionWindow(window_ms, later)
    held_until = NOW + window_ms / 1e3
    for i, n in enumerate([900, 800, 700, 300, 250, 200]):
        ask = Ask(f"r{i}-{n}", n, 16)

        def decide(final: bool, ask: Ask = ask) -> None:
            try:
                dispatcher.dispatch(ask, PrefixMatch(), prefill, decode, held_until, arrival=NOW, final=final)
                admitted.append(ask.request_id)
            except OverloadedError as e:
                assert e.reason in ("ttft", "deadline")
                refused.append(ask.request_id)

        window.hold(*dispatcher.window_key(ask, PrefixMatch()), decide)
    later.run()
    return admitted, refused


def test_a_burst_decided_in_a_window_admits_its_short_prompts() -> None:
    fcfs, _ = burst(0.0)
    # 900 + 800 ms of prefill, then 200 + 1.5 steps (joining a decoding batch) is over 2 s
    assert fcfs == ["r0-900", "r1-800"]
    sjf, refused = burst(20.0)
    assert sjf == ["r5-200", "r4-250", "r3-300", "r2-700"]  # 1450 ms; 800 more would miss 2 s
    assert refused == ["r1-800", "r0-900"]


def test_the_held_time_counts_in_the_predicted_ttft() -> None:
    dispatcher = Dispatcher(AdmissionConfig(), COST, 16)
    prefill, decode = [PrefillSide("p0", PrefillLedger())], [DecodeSide("d0", DecodeLedger(total_blocks=1000))]
    at_once = dispatcher.dispatch(Ask("a", 100, 16), PrefixMatch(), prefill, decode, NOW)
    prefill, decode = [PrefillSide("p0", PrefillLedger())], [DecodeSide("d0", DecodeLedger(total_blocks=1000))]
    held = dispatcher.dispatch(Ask("b", 100, 16), PrefixMatch(), prefill, decode, NOW + 0.05, arrival=NOW)
    assert held.decision.prediction.predicted_ttft_ms == pytest.approx(
        at_once.decision.prediction.predicted_ttft_ms + 50.0)
    # due 2 s after it arrived, not after the hold; queued in the order decided (decision + 2 s)
    assert held.candidate.deadline == pytest.approx(at_once.candidate.deadline)
    assert held.deadline == pytest.approx(at_once.deadline + 0.05)
    assert held.decision.joins_in_ms == pytest.approx(at_once.decision.joins_in_ms)  # from the decision on


def test_a_kept_request_is_looked_at_again_on_relook_and_last_when_its_time_runs_out() -> None:
    later, looks = Later(), []
    window = AdmissionWindow(20.0, later)
    fits_at = {"a": 2, "b": 99}  # the look at which each fits

    def decide(name: str, final: bool) -> None:
        looks.append((name, final))
        if not final and sum(n == name for n, _ in looks) < fits_at[name]:
            raise SecondLook(1.5)

    for name, ms in (("b", 200.0), ("a", 100.0)):
        window.hold(1, ms, lambda final, n=name: decide(n, final))
    later.run()  # the flush: both kept, each with one last look scheduled at its time's end
    assert looks == [("a", False), ("b", False)] and window.held == 2
    assert sorted(d for d, _ in later.calls) == [1.5, 1.5]
    window.relook()  # a prefill ended: "a" fits now, "b" is kept (no new timer)
    assert looks[2:] == [("a", False), ("b", False)] and window.held == 1 and len(later.calls) == 2
    later.run()  # both timers: "a" was decided already (nothing), "b" for good
    assert looks[4:] == [("b", True)] and window.held == 0
    window.relook()  # nothing kept: nothing to decide
    assert len(looks) == 5


def test_second_looks_admit_what_the_queue_ahead_freed_and_refuse_the_rest_at_their_last() -> None:
    dispatcher = Dispatcher(AdmissionConfig(), COST, 16)
    ledger = PrefillLedger()
    prefill, decode = [PrefillSide("p0", ledger)], [DecodeSide("d0", DecodeLedger(total_blocks=10_000))]
    later, admitted, refused = Later(), [], []
    window = AdmissionWindow(20.0, later)
    clock = [NOW + 0.02]
    for i, n in enumerate([900, 800, 300, 250, 200, 700]):
        ask = Ask(f"r{i}-{n}", n, 16)

        def decide(final: bool, ask: Ask = ask) -> None:
            try:
                dispatcher.dispatch(ask, PrefixMatch(), prefill, decode, clock[0], arrival=NOW, final=final)
                admitted.append(ask.request_id)
            except OverloadedError:
                refused.append(ask.request_id)

        window.hold(*dispatcher.window_key(ask, PrefixMatch()), decide)
    later.run()
    assert admitted == ["r4-200", "r3-250", "r2-300", "r5-700"] and refused == [] and window.held == 2
    # each fits alone only if it starts within 2 s - 20 ms held - its prefill - one 60 ms step
    assert sorted(round(d, 3) for d, _ in later.calls) == [pytest.approx(1.02), pytest.approx(1.12)]
    clock[0] = NOW + 0.6  # the four prefills ended in 580 ms, not the 1450 predicted
    for rid in admitted:
        ledger.finish(rid, clock[0])
    window.relook()
    assert admitted[4:] == ["r1-800"] and window.held == 1  # 0.6 + 0.8 s + its first step fits 2 s
    later.run()  # the last looks: r1 was admitted already; r0 (0.6 + 0.8 + 0.9 s) is refused for good
    assert refused == ["r0-900"] and window.held == 0
    assert dispatcher.stats.decisions[("standard", "rejected", "ttft")] == 1  # counted once, at its last look
    assert dispatcher.stats.decisions[("standard", "admitted", "")] == 5
