"""`halfmoon bench serve --defaults-compare`: the precisions and their flags, flag checks, the
ratios against serve's default from given run records, and the comparison itself with real 1P1D
clusters (fp32 and bf16, one of them serve's default here)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from halfmoon.bench import precision_bench as pb
from halfmoon.bench.serve_args import parse_args
from halfmoon.conductor.serve_defaults import SERVE_QUANTIZATION
from halfmoon.engine.config import auto_dtype


def test_the_precisions_their_flags_and_serves_default() -> None:
    assert [p.name for p in pb.PRECISIONS] == ["fp32", "bf16", "bf16+int8", "bf16+int4", "fp32+int4"]
    # serve's `--dtype auto` as resolved on this machine
    assert pb.serve_default() == pb.Precision(auto_dtype("cpu")[0], SERVE_QUANTIZATION) in pb.PRECISIONS
    assert pb.precision_args("--prefill 1", pb.BF16) == "--prefill 1 --dtype bfloat16 --quantization none"
    for bad in ("--prefill 1 --dtype float32", "--quantization=int4"):
        with pytest.raises(ValueError, match="must not set --dtype or --quantization"):
            pb.precision_args(bad, pb.BF16)
    # a subset always keeps bf16 and the default (the headline's two sides), in PRECISIONS' order
    assert [p.name for p in pb.chosen("bf16+int4,fp32")] == ["fp32", "bf16", "bf16+int4"]
    assert pb.chosen(None) == pb.PRECISIONS
    with pytest.raises(ValueError, match="unknown fp8"):
        pb.chosen("fp32,fp8")


@pytest.mark.parametrize("argv, message", [
    (["--defaults-compare", "--synthetic", "quoting"], "replays the synthetic chat workload"),
    (["--defaults-compare", "--trace", "t.jsonl"], "replays the synthetic chat workload"),
    (["--defaults-compare", "--target", "h:1"], "no --compare, --target"),
    (["--defaults-compare", "--cluster-args=--prefill 1 --dtype float32"], "must not set --dtype"),
    (["--defaults-compare", "--precisions", "fp16"], "unknown fp16"),
])
def test_flags_that_do_not_fit_the_comparison_are_refused(argv: list[str], message: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def _record(goodput: float) -> dict[str, Any]:
    """A made-up run record (not measured): the fields the report and table read."""
    return {"metrics": {"goodput_rps": goodput, "completed": 10, "rejected": 0, "slo_attainment_pct": 90.0,
                        "ttft_ms": {"p90": 900.0}, "tbt_ms": {"p90": 90.0},
                        "throughput": {"output_tokens_per_s": 100.0}}}


def test_ratios_are_taken_against_the_default_and_the_headline_can_miss() -> None:
    args = argparse.Namespace(cluster_args="--prefill 1 --decode 1", duration=30.0, seed=0, ttft_slo_ms=2000.0,
                              tbt_slo_ms=200.0, send_slo=True)
    runs = {"fp32": [_record(1.0), _record(1.5)], "bf16": [_record(1.5), _record(2.0)],
            "bf16+int4": [_record(1.2), _record(2.5)]}
    default = pb.BF16
    rep = pb.report(args, ["--defaults-compare"], [1.5, 3.0], runs, default)
    low, high = rep["per_rate"]
    assert low["precisions"]["fp32"]["vs_default"] == pytest.approx(1.0 / 1.5)
    assert (low["best_other"], low["default_vs_best_other"]) == ("bf16+int4", pytest.approx(1.5 / 1.2))
    assert (high["best_other"], high["default_vs_best_other"]) == ("bf16+int4", pytest.approx(2.0 / 2.5))
    assert low["default_vs_bf16"] == 1.0 and rep["target_met"]  # the default is bf16: itself
    text = pb.render_table(rep, runs)
    assert "bf16 (default)" in text and "0.67x" in text
    rep = pb.report(args, [], [1.5, 3.0], runs, pb.Precision("bfloat16", "int4"))  # were int4 the default
    assert [e["met"] for e in rep["per_rate"]] == [False, True] and not rep["target_met"]
    assert rep["per_rate"][0]["default_vs_bf16"] == pytest.approx(1.2 / 1.5)


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_comparison_starts_a_cluster_per_precision_and_reports_against_the_default(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "halfmoon.cli.main", "bench", "serve", "--defaults-compare", "--precisions", "fp32",
         "--rates", "1", "--duration", "3", "--seed", "2", "--max-output-tokens", "8", "--warmup", "1",
         "--ttft-slo-ms", "60000", "--tbt-slo-ms", "60000", "--no-progress", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    default = pb.serve_default().name  # `auto` on this machine: bf16 or fp32, run either way
    assert f"headline: goodput {default} (default) / bf16" in proc.stdout
    rep = json.loads((tmp_path / "defaults_bench.json").read_text())
    assert rep["default"] == default and set(rep["runs"]) == {"fp32", "bf16"}
    assert rep["runs"]["fp32"][0]["serve_args"].endswith("--dtype float32 --quantization none")
    for name in ("fp32", "bf16"):
        m = rep["runs"][name][0]["metrics"]
        assert m["completed"] == m["requests"] > 0 and m["errors"] == 0
    bf16_log = (tmp_path / "serve-bf16.log").read_text()
    assert "precision bfloat16, quantization none (asked: serve's default is --dtype auto)" in bf16_log
