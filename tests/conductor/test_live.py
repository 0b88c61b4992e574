"""The dashboard's recent history (conductor/live.py): bins, percentiles, SLO outcome, rejections,
bounded memory; the traffic log's Mooncake rows and hash ids."""

from __future__ import annotations

import json
import math

import pytest

from halfmoon.conductor.admission import AdmissionConfig, resolve
from halfmoon.conductor.backend import Slo
from halfmoon.conductor.live import HASH_BLOCK_TOKENS, LiveWindow, TrafficRecorder
from halfmoon.core.messages import RequestEnd, Timings, Usage
from halfmoon.core.params import FinishReason
from halfmoon.sim.trace import parse_line


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def end(ttft_ms: float, tpot_ms: float, tokens: int = 10, prompt: int = 100, cached: int = 0) -> RequestEnd:
    return RequestEnd(FinishReason.LENGTH, None, Usage(prompt, cached, tokens),
                      Timings(0.0, 0.0, 0.0, ttft_ms, tpot_ms, ttft_ms + tpot_ms * tokens))


STANDARD = resolve(AdmissionConfig(), None, Slo())  # 2000 ms TTFT, 150 ms TBT


def test_finished_requests_land_in_their_bin_with_percentiles_and_slo_outcome() -> None:
    clock = Clock(1000.0)
    window = LiveWindow(bin_s=5.0, history_s=60.0, clock=clock)
    for ttft in (100.0, 200.0, 300.0, 400.0):
        window.finished(end(ttft, 50.0), STANDARD)
    window.finished(end(2500.0, 50.0), STANDARD)  # misses TTFT
    window.finished(end(100.0, 200.0), STANDARD)  # misses TBT
    clock.t = 1007.0  # the next bin
    window.finished(end(1000.0, 10.0, tokens=1), STANDARD)  # one token: no TBT, TTFT met
    snap = window.snapshot()
    s = snap.series
    assert len(s.t) == 12 and s.t[-1] == 1005.0 and s.t[-2] == 1000.0
    assert s.request_rate[-2] == pytest.approx(6 / 5) and s.goodput_rps[-2] == pytest.approx(4 / 5)
    assert s.ttft_ms["p50"][-2] == pytest.approx(250.0)  # 100 100 200 300 400 2500: linear
    assert s.tbt_ms["p99"][-2] == pytest.approx(50 + 150 * 0.95)  # 50 x5, 200
    assert s.tbt_ms["p50"][-1] is None and s.ttft_ms["p50"][-1] == 1000.0
    assert all(v is None for v in s.ttft_ms["p90"][:-2])  # empty bins are gaps
    assert snap.finished == 7 and snap.slo_attainment == pytest.approx(5 / 7)
    assert snap.goodput_rps == pytest.approx(5 / 7.0)  # the server is 7 s old: rates over 7 s


def test_rejections_by_reason_and_errors_are_counted_and_binned() -> None:
    clock = Clock(50.0)
    window = LiveWindow(bin_s=1.0, history_s=10.0, clock=clock)
    window.rejected("ttft")
    window.rejected("ttft")
    window.rejected("")
    window.failed()
    snap = window.snapshot()
    assert snap.rejected == {"ttft": 2, "overloaded": 1} and snap.errors == 1
    assert snap.series.rejected_rps[-1] == 3.0 and snap.slo_attainment is None


def test_old_bins_roll_off_and_the_reservoir_bounds_memory() -> None:
    clock = Clock(0.0)
    window = LiveWindow(bin_s=1.0, history_s=3.0, max_samples=16, clock=clock)
    for i in range(1000):
        window.finished(end(float(i), 10.0), resolve(AdmissionConfig(standard_ttft_ms=0), None, Slo()))
    assert len(window._bins[-1].ttft_ms) == 16  # noqa: SLF001 - the bound is the point
    p50 = window.snapshot().series.ttft_ms["p50"][-1]
    assert p50 is not None and 200 < p50 < 800  # a uniform sample of 0..999
    clock.t = 10.0
    snap = window.snapshot()
    assert all(v is None for v in snap.series.ttft_ms["p50"]) and snap.finished == 1000
    assert snap.goodput_rps == 0.0 and math.isclose(snap.request_rate, 0.0)


def test_a_request_without_objectives_counts_as_good() -> None:
    window = LiveWindow(clock=Clock())
    batch = resolve(AdmissionConfig(), "batch", Slo())
    window.finished(end(60_000.0, 900.0), batch)
    assert window.snapshot().slo_attainment == 1.0


def test_traffic_rows_are_a_valid_mooncake_trace_sharing_hash_ids_on_shared_prefixes() -> None:
    traffic = TrafficRecorder()
    shared = list(range(HASH_BLOCK_TOKENS))
    traffic.record(100.0, shared + [1, 2, 3], 20)
    traffic.record(100.5, shared + list(range(600)), 7)  # same first block, then new ones
    traffic.record(101.0, shared, 5, cache_salt="tenant-b")  # another tenant: no sharing
    traffic.record(90.0, [5] * 10, 3)  # before the window asked for
    rows = traffic.rows(since=95.0)
    assert [r.timestamp_ms for r in rows] == [0.0, 500.0, 1000.0]
    assert [r.input_length for r in rows] == [515, 1112, 512] and [r.output_length for r in rows] == [20, 7, 5]
    a, b, c = (r.hash_ids for r in rows)
    assert len(a) == 2 and len(b) == 3 and len(c) == 1
    assert a[0] == b[0] and a[1] != b[1] and c[0] not in (a + b)
    for n, row in enumerate(rows, start=1):  # each line is what the simulator reads
        parsed = parse_line(json.dumps(row.as_json()), n)
        assert parsed.hash_ids == row.hash_ids
    assert len(traffic) == 4


def test_traffic_is_bounded() -> None:
    traffic = TrafficRecorder(max_rows=3)
    for i in range(5):
        traffic.record(float(i), [i], 1)
    assert len(traffic) == 3 and [r.input_length for r in traffic.rows(0.0)] == [1, 1, 1]



def test_the_traffic_log_names_each_requests_adapter_and_never_shares_a_prefix_across_adapters() -> None:
    traffic = TrafficRecorder()
    prompt = list(range(1200))
    for adapter in ("a", "a", "b", ""):
        traffic.record(100.0, prompt, 4, None, adapter)
    rows = [r.as_json() for r in traffic.rows(0.0)]
    assert [r.get("adapter") for r in rows] == ["a", "a", "b", None]
    assert rows[0]["hash_ids"] == rows[1]["hash_ids"]
    assert not set(rows[0]["hash_ids"]) & set(rows[2]["hash_ids"])
    assert not set(rows[0]["hash_ids"]) & set(rows[3]["hash_ids"])
    assert parse_line(json.dumps(rows[2]), 1).adapter == "b"  # the simulator reads it back
