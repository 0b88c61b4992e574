"""`halfmoon bench serve --synthetic quoting --speculative-compare`: the quoting workload, the
gains table, flag checks, a replay of the workload against the in-process server, and the
comparison itself with two real 1P1D clusters (`--speculative off`, then `ngram`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from halfmoon.bench import serve_bench as sb
from halfmoon.bench import spec_serve_bench as ssb
from halfmoon.bench.serve_args import parse_args
from halfmoon.bench.workload import Caps
from tests.conductor import conftest as server_fixtures



def test_quoting_prompts_are_the_files_prompts_in_the_chat_template() -> None:
    from halfmoon.engine.worker import tokenizer_for_model

    prompts = ssb.quoting_prompts("smollm2")
    lines = [line for line in ssb.QUOTING_FILE.read_text().splitlines() if line.strip()]
    assert len(prompts) == len(lines) >= 8
    text = tokenizer_for_model("smollm2").decode(list(prompts[0]))
    assert json.loads(lines[0])["prompt"] in text and text.rstrip().endswith("assistant")  # the turn to answer


def test_quoting_workload_cycles_the_prompts_and_ends_at_eos() -> None:
    prompts = [(101, 102, 103), (201, 202), (301,)]
    w = ssb.quoting_workload(2.0, 10.0, seed=3, prompts=prompts)
    assert w == ssb.quoting_workload(2.0, 10.0, seed=3, prompts=prompts)  # deterministic
    assert len(w.requests) > 6 and w.duration_s == 10.0
    assert [r.prompt_ids for r in w.requests[:4]] == [prompts[0], prompts[1], prompts[2], prompts[0]]
    assert all(not r.ignore_eos and r.max_tokens == ssb.QUOTING_MAX_TOKENS for r in w.requests)
    arrivals = [r.arrival_s for r in w.requests]
    assert arrivals == sorted(arrivals) and 0 < arrivals[0] and arrivals[-1] < 10.0
    capped = ssb.quoting_workload(2.0, 10.0, seed=3, prompts=prompts, caps=Caps(2, 5))
    assert capped.requests[0].prompt_ids == (101, 102) and capped.requests[0].max_tokens == 5
    with pytest.raises(ValueError, match="no quoting prompts"):
        ssb.quoting_workload(1.0, 1.0, 0, [])


def test_the_served_model_and_the_mode_flags() -> None:
    assert ssb.served_model("--prefill 1 --decode 1") == "smollm2"
    assert ssb.served_model("--prefill 1 --model gemma3-270m --decode 1") == "gemma3-270m"
    assert ssb.served_model("--model=/m/x.gguf") == "/m/x.gguf"
    assert ssb.mode_args("--prefill 1", "ngram") == "--prefill 1 --speculative ngram"
    with pytest.raises(ValueError, match="must not set --speculative"):
        ssb.mode_args("--prefill 1 --speculative ngram", "off")


@pytest.mark.parametrize("argv, message", [
    (["--speculative-compare"], "add --synthetic quoting"),
    (["--speculative-compare", "--synthetic", "quoting", "--target", "h:1"], "no --compare, --target"),
    (["--speculative-compare", "--synthetic", "quoting", "--cluster-args=--speculative off"],
     "must not set --speculative"),
])
def test_flags_that_do_not_fit_the_comparison_are_refused(argv: list[str], message: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def _run(tbt_p50: float, tpot_p50: float, goodput: float) -> dict[str, Any]:
    return {"metrics": {"tbt_ms": {"p50": tbt_p50}, "tpot_ms": {"p50": tpot_p50}, "ttft_ms": {"p50": 300.0},
                        "goodput_rps": goodput, "slo_attainment_pct": 100.0 * goodput,
                        "throughput": {"output_tokens_per_s": 10.0}}}


def test_gains_run_the_right_way_for_each_metric() -> None:
    runs = {"off": [_run(60.0, 50.0, 0.1), _run(90.0, 80.0, 1.0)],
            "ngram": [_run(30.0, 10.0, 0.1), _run(95.0, 85.0, 0.9)]}
    low = {g.key: g for g in ssb.gains(runs, 0, "tbt")}
    assert low["tbt_p50"].gain == pytest.approx(2.0) and low["tbt_p50"].met is True
    assert low["tpot_p50"].gain == pytest.approx(5.0) and low["tpot_p50"].met is None
    assert low["goodput"].target is None
    high = {g.key: g for g in ssb.gains(runs, 1, "goodput")}
    assert high["goodput"].gain == pytest.approx(0.9) and high["goodput"].met is False
    assert high["tbt_p50"].target is None
    table = ssb.render_gains(list(high.values()))
    assert "MISSED" in table and "0.90x" in table
    runs["off"][1]["metrics"]["goodput_rps"] = 0.0  # no gain where it would divide by zero
    assert "goodput" not in {g.key for g in ssb.gains(runs, 1, "goodput")}


def test_the_quoting_workload_replays_against_the_in_process_server(
        api: server_fixtures.RunningApi, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = sb.main(["--target", api.grpc_target, "--synthetic", "quoting", "--rate", "3", "--duration", "2",
                    "--seed", "1", "--max-output-tokens", "12", "--ttft-slo-ms", "60000", "--tbt-slo-ms", "60000",
                    "--no-progress", "--json", "--out", str(tmp_path)])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["workload"].startswith("synthetic quoting at 3 req/s")
    m = result["runs"][0]["metrics"]
    assert m["requests"] == m["completed"] > 0 and m["errors"] == 0
    rows = json.loads((tmp_path / "serve_bench.json").read_text())["runs"][0]["requests"]
    assert all(0 < r["tokens"] <= 12 for r in rows)


@pytest.mark.long
@pytest.mark.slow
def test_the_comparison_starts_both_clusters_and_reports_the_gains(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "halfmoon.cli.main", "bench", "serve", "--synthetic", "quoting", "--speculative-compare",
         "--rates", "0.5,1", "--duration", "4", "--seed", "4", "--max-output-tokens", "24", "--warmup", "1",
         "--ttft-slo-ms", "60000", "--tbt-slo-ms", "60000", "--no-progress", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert "ngram vs off @ 0.5 req/s (low load" in proc.stdout and "headline: TBT p50 off/ngram" in proc.stdout
    rep = json.loads((tmp_path / "spec_serve_bench.json").read_text())
    assert rep["rates"] == [0.5, 1.0] and set(rep["runs"]) == {"off", "ngram"}
    for mode in ("off", "ngram"):
        assert [r["serve_args"].endswith(f"--speculative {mode}") for r in rep["runs"][mode]] == [True, True]
        assert all(r["metrics"]["completed"] == r["metrics"]["requests"] > 0 for r in rep["runs"][mode])
    assert rep["low"]["gains"]["tbt_p50"]["target"] == ssb.TBT_TARGET
    assert rep["high"]["gains"]["goodput"]["target"] == ssb.GOODPUT_TARGET
    logs = sorted(f.name for f in tmp_path.glob("serve-spec-*.log"))  # a fresh cluster per mode and rate
    assert logs == ["serve-spec-ngram-0.5.log", "serve-spec-ngram-1.log", "serve-spec-off-0.5.log",
                    "serve-spec-off-1.log"]
