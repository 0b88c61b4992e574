"""`halfmoon bench serve --admission`: the calibration search on synthetic attainment curves, the
admission arithmetic on hand-made records, the verdict, the table and the plots, argument
errors, the replay's deadline, a /metrics scrape, a replay against the in-process server, and
one short run of the real command once `halfmoon serve` has `--admission`."""

from __future__ import annotations

import asyncio
import http.server
import json
import math
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from halfmoon.bench import admission_bench as ab
from halfmoon.bench import admission_metrics as am
from halfmoon.bench import admission_report as ar
from halfmoon.bench import serve_bench as sb
from halfmoon.bench import serve_args as sa
from halfmoon.bench import serve_metrics as sm
from halfmoon.bench.workload import Request, Workload, trace_workload
from halfmoon.conductor.admission import AdmissionConfig
from tests.bench.records import record, write_trace
from tests.conductor import conftest as server_fixtures


SLO = sm.Slo(ttft_ms=500.0, tbt_ms=125.0)  # binary fractions: "exactly at the SLO" is exact
SAMPLE_TRACE = Path(__file__).resolve().parents[2] / "halfmoon" / "bench" / "data" / "sample_trace.jsonl"


# ---------------------------------------------------------------------------- calibration


def cliff(at: float):
    """An attainment curve: everything meets the SLOs up to speed `at`, half of it beyond."""
    calls: list[float] = []

    def attainment(speed: float) -> float:
        calls.append(speed)
        return 100.0 if speed <= at else 50.0

    return attainment, calls


def test_search_doubles_to_a_miss_then_bisects_geometrically() -> None:
    attainment, calls = cliff(0.7)
    found = am.search_speed(attainment, start=0.25, target_pct=90.0, max_probes=5)
    # 0.25 ok, 0.5 ok, 1.0 miss, sqrt(0.5) = 0.707 miss, sqrt(0.5 * 0.707) = 0.595 ok
    assert calls == pytest.approx([0.25, 0.5, 1.0, math.sqrt(0.5), 0.5 ** 0.75])
    assert found.speed == pytest.approx(0.5 ** 0.75) and found.failed_at == pytest.approx(math.sqrt(0.5))
    assert [a for _, a in found.probes] == [100.0, 100.0, 50.0, 50.0, 100.0]


def test_search_halves_from_a_start_that_misses() -> None:
    attainment, calls = cliff(0.3)
    found = am.search_speed(attainment, start=2.0, target_pct=90.0, max_probes=4)
    assert calls == pytest.approx([2.0, 1.0, 0.5, 0.25])  # the fourth probe is the first to meet it
    assert (found.speed, found.failed_at) == (0.25, 0.5)


def test_search_stops_at_the_resolution_and_the_probe_budget() -> None:
    attainment, _ = cliff(0.7)
    found = am.search_speed(attainment, 0.25, 90.0, max_probes=20, resolution=1.1)
    assert len(found.probes) < 20 and 1.0 < found.failed_at / found.speed <= 1.1
    assert found.speed <= 0.7 < found.failed_at
    never, _ = cliff(0.0)
    found = am.search_speed(never, 1.0, 90.0, max_probes=3)
    assert found.speed is None and found.failed_at == 0.25 and len(found.probes) == 3
    always, _ = cliff(math.inf)
    found = am.search_speed(always, 1.0, 90.0, max_probes=3)
    assert (found.speed, found.failed_at) == (4.0, None)
    target_is_inclusive = am.search_speed(lambda s: 90.0, 1.0, 90.0, max_probes=1)
    assert target_is_inclusive.speed == 1.0
    with pytest.raises(ValueError):
        am.search_speed(always, 0.0, 90.0, 3)


def test_calibration_json_reports_rates() -> None:
    found = am.Calibration(0.5, 1.0, ((1.0, 40.0), (0.5, 95.0)))
    j = found.to_json(rate_at_1x=0.8)
    assert (j["speed"], j["rate_rps"], j["failed_at_speed"]) == (0.5, 0.4, 1.0)
    assert j["probes"][1] == {"speed": 0.5, "rate_rps": 0.4, "slo_attainment_pct": 95.0}


# ---------------------------------------------------------------------------- workloads


def test_scaled_and_windowed_workloads() -> None:
    w = Workload("t", tuple(Request(float(t), (1, 2), 4) for t in (1, 2, 4, 8)), 8.0)
    fast = am.scaled(w, 2.0)
    assert [r.arrival_s for r in fast.requests] == [0.5, 1.0, 2.0, 4.0] and fast.duration_s == 4.0
    cut = am.windowed(fast, 2.0)
    assert [r.arrival_s for r in cut.requests] == [0.5, 1.0, 2.0] and cut.duration_s == 2.0
    assert am.windowed(fast, 10.0) is fast and am.windowed(fast, None) is fast
    assert am.trace_rate(w) == 0.5 and am.offered_rps(cut) == 1.5
    with pytest.raises(ValueError):
        am.scaled(w, 0.0)


def test_same_requests_replays_the_1x_window_at_every_load(tmp_path: Path) -> None:
    arrivals = [(t * 100, 50, 2, [t]) for t in range(40)]  # one request every 0.1 s for 4 s
    plan = replace(small_plan(tmp_path), trace=trace_workload(write_trace(tmp_path / "u.jsonl", arrivals), 1.0),
                   window_s=2.0)
    spans = {load: plan.at_load(0.5, load) for load in (1.0, 2.0, 4.0)}  # 1x: the trace's first second
    assert [len(w.requests) for w in spans.values()] == [11, 21, 40]  # each load: its own first 2 s
    same = replace(plan, same_requests=True)
    fixed = {load: same.at_load(0.5, load) for load in (1.0, 2.0, 4.0)}
    assert {tuple(r.prompt_ids for r in w.requests) for w in fixed.values()} == {
        tuple(r.prompt_ids for r in fixed[1.0].requests)}  # the same 11 requests
    assert [w.duration_s for w in fixed.values()] == [2.0, 1.0, 0.5]
    assert am.offered_rps(fixed[4.0]) == pytest.approx(4 * am.offered_rps(fixed[1.0]))


# ---------------------------------------------------------------------------- one replay


def admission_records() -> list[sm.RequestRecord]:
    good = record(0.2, [0.05] * 9, prompt=200, cached=64)
    late = record(0.6, [0.05] * 9, prompt=300, cached=100)  # TTFT miss: 200 tokens computed for nothing
    rejected = record(0.0, [], status="rejected", code="RESOURCE_EXHAUSTED", prompt=500)
    failed = record(0.0, [], status="error", code="UNAVAILABLE", prompt=400)  # no usage: all 400
    cut = record(0.0, [], status="timeout", prompt=100)
    return [good, late, rejected, failed, cut]


def test_wasted_prefill_counts_admitted_requests_that_missed_or_failed() -> None:
    records = admission_records()
    assert am.wasted_prefill_tokens(records, SLO) == 200 + 400 + 100
    assert am.admitted_ok_pct(records, SLO) == pytest.approx(25.0)  # 1 of 4 admitted
    assert am.admitted_ok_pct([records[2]], SLO) is None  # nothing admitted


def test_run_metrics_adds_the_admission_figures() -> None:
    m = am.run_metrics(admission_records(), window_s=2.0, makespan_s=5.0, slo=SLO)
    assert (m["requests"], m["admitted"], m["rejected"], m["errors_5xx"], m["timed_out"]) == (5, 4, 1, 1, 1)
    assert m["offered_rps"] == 2.5 and m["goodput_rps"] == 0.5 and m["slo_met"] == 1
    assert m["errors_by_status"] == {"RESOURCE_EXHAUSTED": 1, "UNAVAILABLE": 1}
    assert m["wasted_prefill_tokens"] == 700 and m["admitted_ok_pct"] == pytest.approx(25.0)
    assert m["predictions"] == 0 and m["ttft_prediction_error_pct"] is None


def test_prediction_errors_are_relative_to_the_measured_values() -> None:
    a = record(0.25, [0.1] * 9)  # TTFT 250 ms, TBT 100 ms
    a.prediction = (500.0, 75.0)  # +100%, -25%
    b = record(0.5, [0.2] * 9)  # TTFT 500 ms, TBT 200 ms
    b.prediction = (450.0, 200.0)  # -10%, 0%
    c = record(0.5, [0.2] * 9)  # no prediction: not counted
    one_token = record(0.5, [])  # no TBT to compare
    one_token.prediction = (500.0, 100.0)
    ttft, tbt = am.prediction_errors([a, b, c, one_token])
    assert ttft == pytest.approx([1.0, 0.1, 0.0]) and tbt == pytest.approx([0.25, 0.0])
    m = am.run_metrics([a, b, c, one_token], 2.0, 2.0, SLO)
    assert m["predictions"] == 3 and m["ttft_prediction_error_pct"] == pytest.approx(10.0)
    assert m["tbt_prediction_error_pct"] == pytest.approx(12.5)


def test_predictions_are_read_from_a_message_a_dict_or_nothing() -> None:
    fields = {"predicted_ttft_ms": 300.0, "predicted_tbt_ms": 90.0, "ttft_slo_ms": 1.0, "tbt_slo_ms": 1.0}
    assert sm.predicted_ms(SimpleNamespace(prediction=SimpleNamespace(**fields))) == (300.0, 90.0)
    assert sm.predicted_ms(SimpleNamespace(prediction=fields)) == (300.0, 90.0)
    assert sm.predicted_ms(SimpleNamespace(prediction=None)) is None
    assert sm.predicted_ms(SimpleNamespace()) is None  # an SDK without the field
    rows = ab.rows([record(0.1, [0.1])])
    assert (rows[0]["predicted_ttft_ms"], rows[0]["predicted_tbt_ms"]) == (None, None)


def test_a_request_past_the_replay_deadline_is_cut_off_as_a_timeout() -> None:
    async def forever() -> None:
        await asyncio.Event().wait()  # never set: only the deadline ends it

    async def quick() -> None:
        return None

    cut, done = sm.RequestRecord(0, 0.0, 10, 4), sm.RequestRecord(1, 0.0, 10, 4)

    async def run() -> None:
        await sb.bounded(forever(), cut, lambda: 0.0, deadline_s=0.05)
        await sb.bounded(quick(), done, lambda: 0.0, deadline_s=0.05)

    asyncio.run(asyncio.wait_for(run(), timeout=30))
    assert cut.status == "timeout" and "cut off" in cut.message
    assert done.status == "pending"  # untouched: `send` sets the status of what finishes


# ---------------------------------------------------------------------------- /metrics

METRICS_PAGE = """# HELP halfmoon_index_heartbeat_max_gap_seconds longest gap between heartbeats
# TYPE halfmoon_index_heartbeat_max_gap_seconds gauge
halfmoon_index_heartbeat_max_gap_seconds{worker="prefill-0"} 0.75
halfmoon_index_heartbeat_max_gap_seconds{worker="decode-0"} 1.5
halfmoon_index_resyncs_total{worker="prefill-0"} 2.0
halfmoon_index_resyncs_total{worker="decode-0"} 1.0
halfmoon_index_resyncs_created 1.7e9
halfmoon_requests_total 12.0
"""


def test_index_health_reads_the_heartbeat_metrics_and_none_when_absent() -> None:
    assert am.index_health(METRICS_PAGE) == {"heartbeat_max_gap_s": 1.5, "resyncs": 3.0}
    assert am.index_health("halfmoon_requests_total 3\n") == {"heartbeat_max_gap_s": None, "resyncs": None}


@pytest.fixture
def metrics_url() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = METRICS_PAGE.encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass  # quiet test output

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(timeout=10)


def test_scrape_reads_metrics_and_reports_failures_as_values(metrics_url: str) -> None:
    assert ab.scrape_index_health(metrics_url) == {"heartbeat_max_gap_s": 1.5, "resyncs": 3.0, "scrape_error": None}
    assert ab.scrape_index_health(None)["scrape_error"] == "no HTTP URL"
    failed = ab.scrape_index_health(metrics_url + "/nothing")  # 404
    assert failed["heartbeat_max_gap_s"] is None and failed["scrape_error"]


# ---------------------------------------------------------------------------- verdict and output


def run_row(policy: str, load: float, goodput: float, ok_pct: float | None = 100.0, errors: int = 0,
            **extra: object) -> dict:
    metrics = {"goodput_rps": goodput, "admitted_ok_pct": ok_pct, "errors_5xx": errors, "offered_rps": load,
               "requests": 10, "rejected": 2, "timed_out": 0, "wasted_prefill_tokens": 1234,
               "ttft_ms": {"p90": 900.0}, "tbt_ms": {"p90": 150.0}, "ttft_prediction_error_pct": 12.5,
               "tbt_prediction_error_pct": None, **extra}
    return {"policy": policy, "load": load, "metrics": metrics,
            "index": {"heartbeat_max_gap_s": None, "resyncs": 0.0, "scrape_error": None}}


def test_verdict_met_when_predictive_holds_and_none_collapses() -> None:
    runs = [run_row("none", 1, 1.0), run_row("none", 2, 0.6), run_row("none", 4, 0.2, ok_pct=20.0),
            run_row("predictive", 1, 0.95), run_row("predictive", 2, 0.92, ok_pct=99.5),
            run_row("predictive", 4, 0.9, ok_pct=99.0)]
    v = am.verdict(runs)
    assert (v.predictive_met, v.none_collapsed, v.reasons) == (True, True, ())


def test_verdict_names_every_miss() -> None:
    runs = [run_row("none", 1, 1.0), run_row("none", 4, 0.8),  # 80% of the best: no collapse
            run_row("predictive", 2, 0.85),  # goodput 85% of the best
            run_row("predictive", 4, 0.95, ok_pct=98.0, errors=2)]
    v = am.verdict(runs)
    assert v.predictive_met is False and v.none_collapsed is False
    assert v.reasons == ("predictive at 2x: goodput 85.0% of the best (target >= 90%)",
                         "predictive at 4x: 98.0% of admitted met both SLOs (target >= 99%)",
                         "predictive at 4x: 2 5xx-equivalent errors (target 0)",
                         "none at 4x kept 80.0% of the best goodput (collapse: < 50%)")
    nothing_admitted = am.verdict([run_row("early", 1, 1.0), run_row("predictive", 2, 0.0, ok_pct=None)])
    assert nothing_admitted.predictive_met is False and nothing_admitted.none_collapsed is None
    assert "predictive at 2x: - of admitted met both SLOs (target >= 99%)" in nothing_admitted.reasons
    assert am.verdict([run_row("early", 4, 1.0)]) == am.Verdict(None, None, ())
    no_goodput = am.verdict([run_row("none", 4, 0.0), run_row("predictive", 4, 0.0, ok_pct=None)])
    assert (no_goodput.predictive_met, no_goodput.none_collapsed) == (None, None)
    assert no_goodput.reasons[0].startswith("no run met both SLOs")


def test_mode_table_and_lines() -> None:
    runs = [run_row("none", 1, 0.5), run_row("queue-threshold", 4, 0.25)]
    table = ar.render_mode_table(runs).splitlines()
    assert table[0].startswith("policy") and "goodput" in table[0] and "adm-ok%" in table[0]
    assert set(table[1]) == {"-"} and len(table) == 4
    assert table[3].split()[:9] == ["queue-threshold", "4x", "4.000", "10", "2", "0", "0", "0.250", "50.0"]
    assert "1234" in table[3] and "12.5" in table[3]
    verdict = am.verdict(runs).to_json()
    line = ar.verdict_line("cluster", verdict)
    assert line.startswith("verdict cluster: predictive at >= 2x") and "not judged" in line
    calibration = {**am.Calibration(0.5, 1.0, ((1.0, 40.0), (0.5, 95.0))).to_json(0.8), "given": False,
                   "used_speed": 0.5}
    assert ar.calibration_line("cluster", calibration, 0.8) == \
        "cluster: sustains x0.5 = 0.400 req/s within SLO (probes: x1 -> 40%, x0.5 -> 95%)"
    missed = {**am.Calibration(None, 0.5, ((0.5, 10.0),)).to_json(0.8), "given": False, "used_speed": 0.5}
    assert "no probe met" in ar.calibration_line("colocated", missed, 0.8)


def test_plots_are_written(tmp_path: Path) -> None:
    rejected = [{"status": "rejected", "ttft_ms": None}]
    served = [{"status": "ok", "ttft_ms": t} for t in (100.0, 300.0)] + rejected
    runs = [{**run_row(p, load, 0.5), "requests": served if p == "none" else rejected}
            for p in ("none", "predictive") for load in (1, 4)]  # predictive completes nothing
    files = ar.plot(tmp_path, {"colocated": {"runs": runs}}, slo_ttft_ms=500.0)
    assert [Path(f).name for f in files] == ["admission_goodput_colocated.png", "admission_ttft_cdf_colocated.png"]
    assert all(Path(f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in files)


# ---------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(("extra", "message"), [
    (["--admission", "none,bogus"], "--admission: choose from none,queue-threshold,early,predictive"),
    (["--modes", "disaggregated"], "--modes: choose from cluster,colocated"),
    (["--loads", "1,two"], "--loads: comma-separated numbers"),
    (["--loads", "1,0"], "--loads: every value must be > 0"),
    (["--window-s", "0"], "--window-s must be > 0"),
    (["--base-speed", "-1"], "--base-speed must be > 0"),
    (["--drain-s", "-1"], "--drain-s must be >= 0"),
    (["--probes", "0"], "--probes must be >= 1"),
    (["--attainment-target", "120"], "--attainment-target is a %"),
])
def test_bad_arguments_are_named(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--trace", "t.jsonl", "--admission", "none", *extra]
    with pytest.raises(SystemExit) as exit_info:
        ab.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_arguments_parse_into_lists_and_serve_bench_hands_admission_over(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = ab.parse_args(["--trace", "t", "--admission", "predictive, none", "--loads", "4,1,2,2"])
    assert args.policies == ["predictive", "none"] and args.mode_list == ["cluster", "colocated"]
    assert args.load_list == [1.0, 2.0, 4.0]
    served = AdmissionConfig()  # the SLOs default to serve's standard class, from one place
    assert (args.ttft_slo_ms, args.tbt_slo_ms) == (served.standard_ttft_ms, served.standard_tbt_ms) == (2000.0, 150.0)
    plain = sa.parse_args(["--trace", "t"])
    assert (plain.ttft_slo_ms, plain.tbt_slo_ms) == (served.standard_ttft_ms, served.standard_tbt_ms)
    assert ab.serve_args("--colocated", "early", SLO) == \
        "--colocated --admission early --standard-ttft-ms 500 --standard-tbt-ms 125"
    with pytest.raises(SystemExit):
        sb.main(["--trace", "t", "--admission", "bogus"])  # the admission parser's error, not serve's
    assert "halfmoon bench serve --admission: error: --admission: choose from" in capsys.readouterr().err


# ---------------------------------------------------------------------------- real runs


def small_plan(tmp_path: Path, drain_s: float = 60.0) -> ab.Plan:
    trace = write_trace(tmp_path / "t.jsonl", [(0, 200, 4, [0]), (400, 200, 4, [0]), (800, 150, 4, [7])])
    opts = sb.ReplayOptions(sm.Slo(60000.0, 60000.0), send_slo=False, warmup=1, progress=False)
    workload = trace_workload(trace, 1.0)
    return ab.Plan(workload, window_s=0.5, drain_s=drain_s, opts=opts, log_dir=tmp_path, say=lambda _: None)


@pytest.mark.slow
def test_loads_replayed_against_the_in_process_server(api: server_fixtures.RunningApi, tmp_path: Path) -> None:
    # Whatever the session server's admission makes of requests without objectives: each one
    # is completed (4 tokens, both generous SLOs met) or rejected, never an error.
    plan = small_plan(tmp_path)
    server = ab.Server("colocated", "default", None, api.grpc_target, api.http_url)
    runs = ab.run_loads(server, speed=1.0, loads=[1.0, 2.0], plan=plan)
    assert [(r["load"], r["metrics"]["requests"]) for r in runs] == [(1.0, 2), (2.0, 3)]  # the 0.5 s window
    for run in runs:
        m = run["metrics"]
        assert (m["errors_5xx"], m["timed_out"], m["completed"] + m["rejected"]) == (0, 0, m["requests"])
        assert m["admitted_ok_pct"] in (None, 100.0) and m["wasted_prefill_tokens"] == 0
        assert m["admitted"] == m["completed"] and m["slo_met"] == m["completed"]
        assert run["index"]["scrape_error"] is None  # /metrics answered; the heartbeat may be absent
        assert "cost model" in run["optimum"]["error"]  # no dashboard routes here: said, not raised
        for row in run["requests"]:
            assert (row["status"], row["tokens"]) in (("ok", 4), ("rejected", 0))
            assert row["code"] in (None, "RESOURCE_EXHAUSTED")


@pytest.mark.slow
def test_same_requests_start_every_load_with_a_cold_prefix_cache(api: server_fixtures.RunningApi,
                                                                 tmp_path: Path) -> None:
    # The window's first request (200 tokens, 12 full blocks) at 1x and again at 2x: without a
    # salt per replay the 2x one would find its whole prompt cached by the 1x replay.
    plan = replace(small_plan(tmp_path), same_requests=True)
    server = ab.Server("colocated", "cold", None, api.grpc_target, api.http_url)
    runs = ab.run_loads(server, speed=1.0, loads=[1.0, 2.0], plan=plan)
    firsts = [run["requests"][0] for run in runs]
    assert [(row["status"], row["cached_tokens"]) for row in firsts] == [("ok", 0), ("ok", 0)]
    assert runs[0]["requests"][1]["cached_tokens"] > 0  # within a replay the prefix is shared


@pytest.mark.slow
def test_the_command_runs_a_tiny_colocated_window(tmp_path: Path) -> None:
    missing = ab.missing_serve_flags()
    if missing:
        pytest.skip(f"`halfmoon serve --help` lacks {', '.join(missing)} (issue 18's admission flags)")
    trace = SAMPLE_TRACE
    proc = subprocess.run(
        [sys.executable, "-m", "halfmoon.cli.main", "bench", "serve", "--trace", str(trace), "--admission", "none",
         "--modes", "colocated", "--colocated-args", "--colocated --threads 1 --num-blocks 128",
         "--base-speed", "1", "--loads", "1", "--window-s", "1", "--drain-s", "20", "--max-input-tokens", "256",
         "--max-output-tokens", "4", "--warmup", "1", "--no-progress", "--json", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    (run,) = result["modes"]["colocated"]["runs"]
    m = run["metrics"]
    assert run["policy"] == "none" and m["requests"] >= 1  # the trace's arrivals in the first second
    assert (m["completed"], m["rejected"], m["errors_5xx"]) == (m["requests"], 0, 0)  # `none` admits all
    assert {"heartbeat_max_gap_s", "resyncs"} <= set(run["index"])
    o = run["optimum"]  # on the server's own cost model (GET /dashboard/api/cost-model)
    assert o["method"] == "upper bound" and "co-located" in o["reference"] and o["served"] >= m["slo_met"]
    assert (tmp_path / "admission_goodput_colocated.png").is_file()


def test_same_requests_goodput_is_per_second_of_the_makespan() -> None:
    # The same 10 requests at 1x (150 s) and 4x (37.5 s + a 30 s drain): per second of the window
    # 4x looks 4 times better; per second of the makespan it is judged on what the server did.
    one = {**run_row("predictive", 1, 8 / 150, goodput_makespan_rps=8 / 160), "goodput_basis": "makespan"}
    four = {**run_row("predictive", 4, 6 / 37.5, goodput_makespan_rps=6 / 67.5), "goodput_basis": "makespan"}
    assert am.goodput(four) == pytest.approx(6 / 67.5) and am.best_goodput([one, four]) == pytest.approx(6 / 67.5)
    window = [{**r, "goodput_basis": "window"} for r in (one, four)]
    assert am.best_goodput(window) == pytest.approx(6 / 37.5)
    assert am.goodput(run_row("none", 1, 0.5)) == 0.5  # no basis named: the window's
    m = am.run_metrics(admission_records(), window_s=2.0, makespan_s=8.0, slo=SLO)
    assert m["slo_met"] == 1 and (m["goodput_rps"], m["goodput_makespan_rps"]) == (0.5, 0.125)
