"""`halfmoon bench serve`: metrics on hand-made timelines, workload determinism, a real replay
against the in-process server, and `--compare` with two real `halfmoon serve` processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from halfmoon.bench import serve_bench as sb
from halfmoon.bench import serve_metrics as sm
from halfmoon.bench.serve_args import BASELINE_ARGS
from halfmoon.bench.trace import HASH_BLOCK_TOKENS
from halfmoon.bench.workload import (MIN_TOKEN_ID, SYSTEM_PROMPT_TOKENS, Caps, chat_workload, trace_workload)
from tests.bench.records import record, timeline, write_trace
from tests.conductor import conftest as server_fixtures


RUN_KEYS = {"system", "rate", "target", "serve_args", "workload", "metrics"}
METRIC_KEYS = {"requests", "completed", "rejected", "errors", "errors_by_status", "short_outputs", "ttft_ms",
               "tbt_ms", "tpot_ms", "slo_met", "goodput_rps", "slo_attainment_pct", "prefix_hit_rate",
               "throughput", "window_s", "makespan_s", "max_send_lag_ms"}


# ---------------------------------------------------------------------------- metrics


def test_tbt_is_the_mean_of_the_longest_tenth_of_the_gaps() -> None:
    gaps = [0.05] * 18 + [0.5, 0.3]  # 20 gaps: the longest 2
    assert sm.tbt_s(timeline(gaps)) == pytest.approx(0.4)
    gaps = [0.05] * 26 + [0.9, 0.2, 0.1, 0.06]  # 30 gaps: the longest 3 (floor of 10%)
    assert sm.tbt_s(timeline(gaps)) == pytest.approx((0.9 + 0.2 + 0.1) / 3)
    assert sm.tbt_s(timeline([0.05] * 8 + [0.7])) == pytest.approx(0.7)  # 9 gaps: the longest
    assert sm.tbt_s(timeline([0.2])) == pytest.approx(0.2)
    assert sm.tbt_s([3.0]) is None and sm.tbt_s([]) is None


def test_tpot_is_the_mean_gap_after_the_first_token() -> None:
    assert sm.tpot_s(timeline([0.1, 0.2, 0.3])) == pytest.approx(0.2)
    assert sm.tpot_s([1.0]) is None


def test_stats_are_mean_and_interpolated_percentiles_in_ms() -> None:
    s = sm.stats_ms([x / 1e3 for x in range(1, 101)])  # 1..100 ms
    assert s == pytest.approx({"mean": 50.5, "p50": 50.5, "p90": 90.1, "p99": 99.01})
    assert sm.stats_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_goodput_counts_exactly_the_requests_meeting_both_slos() -> None:
    slo = sm.Slo(ttft_ms=500.0, tbt_ms=125.0)  # binary fractions: "exactly at the SLO" is exact
    records = [record(0.2, [0.05] * 9, prompt=200, cached=64),  # good
               record(0.5, [0.125] * 3),  # good: both exactly at the SLO
               record(0.0, [], prompt=100, cached=16),  # good: one token, no TBT to miss
               record(0.6, [0.05] * 9),  # TTFT miss
               record(0.1, [0.05] * 18 + [0.3, 0.2]),  # TBT miss: mean of the longest 2 gaps = 250 ms
               record(0.0, [], status="rejected", code="RESOURCE_EXHAUSTED"),
               record(0.0, [], status="error", code="INTERNAL")]
    m = sm.summarize(records, window_s=4.0, makespan_s=8.0, slo=slo)
    assert (m["requests"], m["completed"], m["rejected"], m["errors"], m["slo_met"]) == (7, 5, 1, 1, 3)
    assert m["goodput_rps"] == pytest.approx(3 / 4.0)
    assert m["slo_attainment_pct"] == pytest.approx(100 * 3 / 7, abs=0.01)
    assert m["errors_by_status"] == {"INTERNAL": 1, "RESOURCE_EXHAUSTED": 1}
    assert m["prefix_hit_rate"] == pytest.approx(80 / 600)  # completed requests only (not 80 / 800)
    assert m["throughput"]["requests_per_s"] == pytest.approx(5 / 8.0)
    assert m["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert set(m) == METRIC_KEYS


def test_baseline_starts_missing_at_the_first_rate_below_the_attainment_target() -> None:
    runs = [{"rate": r, "metrics": {"slo_attainment_pct": a}} for r, a in ((0.5, 100.0), (1.0, 95.0), (2.0, 40.0))]
    assert sb.headline_rate(runs, 90.0) == 2.0
    assert sb.headline_rate(runs, 99.0) == 1.0
    assert sb.headline_rate(runs[:2], 90.0) == 1.0  # never missed: the highest rate


def test_comparison_ratios_and_a_baseline_with_zero_goodput() -> None:
    slo = sm.Slo(ttft_ms=500.0, tbt_ms=125.0)

    def run(system: str, rate: float, ttfts: list[float]) -> dict:
        metrics = sm.summarize([record(t, [0.05] * 9) for t in ttfts], 2.0, 3.0, slo)
        return {"system": system, "rate": rate, "target": "x", "serve_args": "", "workload": {},
                "metrics": metrics}

    runs = [run("co-located", 1.0, [0.1, 0.2]), run("co-located", 2.0, [0.9, 0.9]),
            run("cluster", 1.0, [0.1, 0.1]), run("cluster", 2.0, [0.2, 0.9])]
    comp = sb.comparison(runs, attainment_target=90.0)
    assert comp.headline_rate == 2.0 and comp.headline_goodput_ratio is None  # baseline goodput 0
    low, high = comp.per_rate
    assert low.figures[0].key == "goodput" and low.figures[0].ratio == pytest.approx(1.0)
    assert low.figures[0].target is None and high.headline and not low.headline
    assert "goodput: co-located 0.000, cluster 0.500 req/s" in high.skipped
    ttft_p50 = next(f for f in high.figures if f.key == "ttft_p50")
    assert ttft_p50.ratio == pytest.approx(550 / 900)
    text = sb.render({"workload": "w", "slo": {"ttft_ms": 500.0, "tbt_ms": 125.0, "sent": True},
                      "machine": {"cpu": "cpu", "cores": 2}}, runs, comp)
    assert "no ratio: goodput" in text
    assert "headline: goodput cluster/co-located = no ratio (co-located 0.000 req/s, cluster 0.500 req/s)" in text
    assert json.loads(json.dumps(comp.to_json()))["per_rate"][1]["headline"] is True


# ---------------------------------------------------------------------------- workloads


def test_chat_workload_is_deterministic_with_a_shared_system_prompt() -> None:
    a, b = chat_workload(2.0, 30.0, seed=7), chat_workload(2.0, 30.0, seed=7)
    assert a == b and len(a.requests) > 20
    assert chat_workload(2.0, 30.0, seed=8) != a
    system = a.requests[0].prompt_ids[:SYSTEM_PROMPT_TOKENS]
    for r in a.requests:
        assert r.prompt_ids[:SYSTEM_PROMPT_TOKENS] == system
        assert 64 + 64 <= len(r.prompt_ids) <= 64 + 384 and 32 <= r.max_tokens <= 128
        assert MIN_TOKEN_ID <= min(r.prompt_ids) and max(r.prompt_ids) < 49152
    assert len({r.prompt_ids[SYSTEM_PROMPT_TOKENS:] for r in a.requests}) == len(a.requests)
    arrivals = [r.arrival_s for r in a.requests]
    assert arrivals == sorted(arrivals) and 0 < arrivals[0] and arrivals[-1] < 30.0
    # Content depends on (seed, index) only: a rate sweep replays the same prompts.
    faster = chat_workload(4.0, 30.0, seed=7)
    assert [r.prompt_ids for r in faster.requests[:10]] == [r.prompt_ids for r in a.requests[:10]]


def test_chat_workload_caps_inputs_and_outputs() -> None:
    w = chat_workload(2.0, 10.0, seed=1, caps=Caps(max_input_tokens=100, max_output_tokens=8))
    assert all(len(r.prompt_ids) == 100 and r.max_tokens == 8 for r in w.requests)


def test_trace_workload_equal_hash_ids_give_equal_token_blocks(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [(2000, 1100, 40, [0, 1, 2]), (500, 1024, 300, [0, 1]),
                                               (1000, 700, 0, [5, 2])])
    w = trace_workload(trace, speed=2.0)
    assert [r.arrival_s for r in w.requests] == [0.25, 0.5, 1.0] and w.duration_s == 1.0
    two, other, three = w.requests  # sorted by arrival
    assert three.prompt_ids[:1024] == two.prompt_ids and len(three.prompt_ids) == 1100
    tail = 1100 - 2 * HASH_BLOCK_TOKENS  # hash id 2: block 1 of `other`, block 2 of `three`
    assert other.prompt_ids[HASH_BLOCK_TOKENS:][:tail] == three.prompt_ids[2 * HASH_BLOCK_TOKENS:]
    assert other.prompt_ids[:HASH_BLOCK_TOKENS] != two.prompt_ids[:HASH_BLOCK_TOKENS]
    assert other.max_tokens == 1  # the API needs at least the first token
    assert all(min(r.prompt_ids) >= MIN_TOKEN_ID for r in w.requests)
    assert trace_workload(trace, speed=2.0) == w


def test_trace_workload_truncates_prompts_and_caps_outputs(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [(0, 1100, 40, [0, 1, 2]), (10, 300, 300, [0])])
    full = trace_workload(trace)
    w = trace_workload(trace, caps=Caps(max_input_tokens=600, max_output_tokens=64), max_requests=1)
    assert len(w.requests) == 1
    assert w.requests[0].prompt_ids == full.requests[0].prompt_ids[:600] and w.requests[0].max_tokens == 40
    capped = trace_workload(trace, caps=Caps(max_input_tokens=600, max_output_tokens=64))
    assert len(capped.requests[1].prompt_ids) == 300 and capped.requests[1].max_tokens == 64


# ---------------------------------------------------------------------------- real runs


def test_real_replay_against_the_in_process_server(api: server_fixtures.RunningApi, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # seed 2 at 2 req/s for 3 s: 5 requests spread over 2.4 s, so later ones find the system prompt cached.
    code = sb.main(["--target", api.grpc_target, "--synthetic", "chat", "--rate", "2", "--duration", "3",
                    "--seed", "2", "--max-output-tokens", "8", "--ttft-slo-ms", "60000", "--tbt-slo-ms", "60000",
                    "--no-progress", "--json", "--out", str(tmp_path)])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert {"bench", "date", "command", "machine", "workload", "slo", "runs", "files"} <= set(result)
    (run,) = result["runs"]
    assert set(run) == RUN_KEYS and set(run["metrics"]) == METRIC_KEYS
    m = run["metrics"]
    assert (m["requests"], m["completed"], m["rejected"], m["errors"], m["short_outputs"]) == (5, 5, 0, 0, 0)
    assert m["slo_met"] == 5 and m["goodput_rps"] == pytest.approx(5 / 3.0)
    assert m["prefix_hit_rate"] > 0
    assert m["ttft_ms"]["p50"] > 0 and m["tbt_ms"]["p99"] >= m["tbt_ms"]["p50"] > 0
    saved = json.loads((tmp_path / "serve_bench.json").read_text())
    rows = saved["runs"][0]["requests"]
    assert [r["tokens"] for r in rows] == [8] * 5 and all(r["status"] == "ok" for r in rows)
    # Hits are whole 16-token blocks of the shared 64-token system prompt (user turns differ).
    assert {r["cached_tokens"] for r in rows} <= {0, 64} and sum(r["cached_tokens"] for r in rows) >= 64
    for name in ("ttft_cdf.png", "tbt_cdf.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def colocated_serve_args() -> str:
    """`halfmoon serve` flags of a small co-located server, with `--colocated` once serve has it
    (then the cluster is its default)."""
    from halfmoon.cli.main import build_parser

    _, unknown = build_parser().parse_known_args(["serve", "--colocated"])
    return ("" if unknown else "--colocated ") + "--threads 1 --num-blocks 128"


@pytest.mark.slow
def test_compare_runs_both_configurations_and_reports_ratios(tmp_path: Path) -> None:
    serve = colocated_serve_args()  # co-located on both sides: the mechanics, not the cluster
    proc = subprocess.run(
        [sys.executable, "-m", "halfmoon.cli.main", "bench", "serve", "--compare", "--baseline-args", serve,
         "--cluster-args", serve, "--rates", "1,2", "--duration", "2", "--seed", "2", "--max-output-tokens", "4",
         "--ttft-slo-ms", "60000", "--tbt-slo-ms", "60000", "--no-progress", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cluster (halfmoon column) vs co-located @ 2 req/s  <- headline" in proc.stdout
    assert "headline: goodput cluster/co-located = 1.00x @ 2 req/s" in proc.stdout
    result = json.loads((tmp_path / "serve_bench.json").read_text())
    assert [(r["system"], r["rate"]) for r in result["runs"]] == [
        ("co-located", 1.0), ("co-located", 2.0), ("cluster", 1.0), ("cluster", 2.0)]
    assert all(r["metrics"]["completed"] == r["metrics"]["requests"] > 0 for r in result["runs"])
    comp = result["comparison"]
    assert comp["headline_rate"] == 2.0  # never missed at 100% attainment: the highest rate
    assert comp["headline_goodput_ratio"] == pytest.approx(1.0)  # same workload, all good on both
    head = next(e for e in comp["per_rate"] if e["headline"])
    assert head["figures"]["goodput"]["target"] == 2.0 and "ttft_p90" in head["figures"]
    assert (tmp_path / "goodput_vs_rate.png").is_file()
    assert (tmp_path / "serve-co-located.log").is_file() and (tmp_path / "serve-cluster.log").is_file()


def test_the_otlp_sink_reaches_every_server_the_bench_starts() -> None:
    """`--otlp-sink`: each started server gets `--otlp-endpoint` (tracing's cost is measured with a
    real exporter); an existing target is left alone."""
    args = sb.parse_args(["--compare", "--otlp-sink", "--cluster-args", "--prefill 1 --decode 1 --tracing"])
    started = sb.systems(args, "http://127.0.0.1:4317")
    assert [s.serve_args for s in started] == [
        BASELINE_ARGS + " --otlp-endpoint http://127.0.0.1:4317",
        "--prefill 1 --decode 1 --tracing --otlp-endpoint http://127.0.0.1:4317"]
    assert sb.systems(sb.parse_args(["--target", "h:1"]), "http://x:1")[0].serve_args is None
