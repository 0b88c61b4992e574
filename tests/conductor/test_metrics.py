"""The front door's Prometheus metrics (api/metrics.py): latency histograms by class and
worker, trace ids as exemplars in the OpenMetrics scrape, the plain text format otherwise."""

from __future__ import annotations

from halfmoon.conductor.backend import BackendStats
from halfmoon.api.metrics import Metrics
from halfmoon.core.messages import RequestEnd, Timings, Usage
from halfmoon.core.params import FinishReason


def test_latency_samples_carry_the_trace_id_as_an_exemplar_in_openmetrics() -> None:
    metrics = Metrics(lambda: BackendStats(0, 0, 0, 0, 0))
    done = RequestEnd(FinishReason.LENGTH, None, Usage(10, 0, 5), Timings(1.0, 2.0, 0.0, 30.0, 5.0, 60.0),
                      prefill_worker="prefill-0", decode_worker="decode-1")
    metrics.finished("http", done, "interactive", trace_id="4bf92f3577b34da6a3ce929d0e0e4736")
    text, content_type = metrics.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    line = next(x for x in text.decode().splitlines()
                if x.startswith("halfmoon_time_to_first_token_seconds_bucket") and 'le="0.05"' in x)
    assert 'class="interactive"' in line and 'worker="prefill-0"' in line
    assert '# {trace_id="4bf92f3577b34da6a3ce929d0e0e4736"}' in line
    plain, plain_type = metrics.render(None)
    assert plain_type.startswith("text/plain") and b"trace_id" not in plain
    assert b'halfmoon_time_per_output_token_seconds_count{class="interactive",worker="decode-1"} 1.0' in plain


def test_goodput_counts_requests_meeting_both_objectives_by_class() -> None:
    from halfmoon.conductor.admission import AdmissionConfig, resolve
    from halfmoon.conductor.backend import Slo
    from halfmoon.conductor.live import meets

    standard = resolve(AdmissionConfig(), None, Slo())  # 2000 ms / 150 ms
    fast = RequestEnd(FinishReason.LENGTH, None, Usage(10, 0, 5), Timings(0.0, 0.0, 0.0, 300.0, 40.0, 500.0))
    slow = RequestEnd(FinishReason.LENGTH, None, Usage(10, 0, 5), Timings(0.0, 0.0, 0.0, 300.0, 400.0, 2000.0))
    assert meets(fast, standard) and not meets(slow, standard)
    metrics = Metrics(lambda: BackendStats(0, 0, 0, 0, 0))
    for end in (fast, fast, slow):
        metrics.finished("grpc", end, "standard", met=meets(end, standard))
    text = metrics.render(None)[0].decode()
    assert 'halfmoon_requests_slo_total{class="standard",outcome="met"} 2.0' in text
    assert 'halfmoon_requests_slo_total{class="standard",outcome="missed"} 1.0' in text


def planner_snapshot(mode: str = "act"):
    """A planner that moved once (a flip toward 1P3D), held twice and failed one move."""
    from halfmoon.conductor.planner import Decision, Split
    from halfmoon.conductor.planner_loop import PlannerSnapshot

    hold = Decision(10.0, "hold", Split(2, 2), Split(2, 2), "2P2D serves the last window best")
    flip = Decision(40.0, "flip", Split(2, 2), Split(1, 3), "1P3D is predicted to serve +35% goodput", "decode",
                    0.35, applied=True)
    return PlannerSnapshot(mode, 30.0, Split(1, 3), Split(1, 3), (hold, hold, flip),
                           {"hold": 2, "flip": 1}, failed=1, busy=True)


def test_planner_metrics_show_the_split_the_desired_one_and_the_decisions() -> None:
    metrics = Metrics(lambda: BackendStats(0, 0, 0, 0, 0, planner=planner_snapshot()))
    lines = set(metrics.render(None)[0].decode().splitlines())
    for line in ('halfmoon_planner_mode{mode="act"} 1.0', 'halfmoon_planner_mode{mode="advise"} 0.0',
                 'halfmoon_planner_workers{role="prefill"} 1.0', 'halfmoon_planner_workers{role="decode"} 3.0',
                 'halfmoon_planner_desired_workers{role="prefill"} 1.0',
                 'halfmoon_planner_desired_workers{role="decode"} 3.0',
                 'halfmoon_planner_decisions_total{action="hold"} 2.0',
                 'halfmoon_planner_decisions_total{action="flip"} 1.0',
                 'halfmoon_planner_decisions_total{action="rollback"} 0.0',
                 "halfmoon_planner_moves_failed_total 1.0", "halfmoon_planner_last_gain 0.35",
                 "halfmoon_planner_busy 1.0"):
        assert line in lines, line


def test_no_planner_series_when_the_planner_is_off() -> None:
    """Off (or co-located) the backend reports no snapshot and /metrics has no planner series."""
    text = Metrics(lambda: BackendStats(0, 0, 0, 0, 0)).render(None)[0].decode()
    assert "halfmoon_requests_running" in text and "halfmoon_planner_" not in text
