"""`halfmoon sim` and `halfmoon sim sweep` end to end: output, files, and Helm values the chart's
schema accepts."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from cli.main import main
from conductor.serve_defaults import tier_tokens
from engine.config import EngineConfig
from sim.builtin import load as load_profile
from tests.deploy.values import drop_nulls, merge
from tests.sim.support import sample_trace

CHART = Path(__file__).resolve().parents[2] / "helm" / "halfmoon"
SLO = ["--standard-ttft-ms", "5000", "--standard-tbt-ms", "300"]


def test_sim_prints_the_shape_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["sim", "--trace", str(sample_trace()), "--profile", "llama3-8b-h100", "--prefill", "2",
            "--decode", "1", "--host-tokens", "100000", "--out", str(tmp_path), *SLO]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "halfmoon sim: 2P1D" in text and "goodput" in text and "prefix hits: device" in text
    summary = json.loads((tmp_path / "sim.json").read_text())
    assert summary["requests"] == sum(1 for line in sample_trace().read_text().splitlines() if line.strip())
    assert set(summary["utilisation"]) == {"prefill-0", "prefill-1", "decode-0"}
    assert (tmp_path / "sim.png").stat().st_size > 0


def test_sweep_recommends_a_shape_whose_helm_values_the_chart_accepts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["sim", "sweep", "--trace", str(sample_trace()), "--profile", "llama3-8b-a100", "--workers", "3",
            "--device-tokens", "16384,65536", "--host-tokens", "0,200000", "--speed", "4", "--out",
            str(tmp_path), "--json", "--no-progress", *SLO]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["rows"]) == 2 * 2 * 2  # P:D in {1:2, 2:1} x device x host
    best = result["best"]
    assert best["goodput_per_worker"] == max(r["goodput_per_worker"] for r in result["rows"])
    assert (tmp_path / "sweep.png").stat().st_size > 0
    snippet = yaml.safe_load((tmp_path / "values.yaml").read_text())
    assert snippet["prefill"]["replicas"] == best["prefill"] and snippet["decode"]["replicas"] == best["decode"]
    assert snippet["engine"]["numBlocks"] == best["device_tokens"] // 16
    kv = load_profile("llama3-8b-a100").kv_bytes_per_token  # hostGb is GiB, as --host-cache-gb: it holds the tier
    assert tier_tokens(EngineConfig(host_cache_gb=snippet["kvTiers"]["hostGb"]), kv).host >= best["host_tokens"]
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = merge(yaml.safe_load((CHART / "values.yaml").read_text()), snippet)
    jsonschema.Draft7Validator(schema).validate(drop_nulls(values))


@pytest.mark.parametrize(("extra", "message"), [
    (["--workers", "1"], "budget of >= 2 workers"),
    (["--device-tokens", "lots"], "--device-tokens takes integers"),
])
def test_bad_sweep_arguments_are_named(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["sim", "sweep", "--trace", str(sample_trace()), "--profile", "llama3-8b-h100", "--workers", "2", *extra]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_sweep_without_a_budget_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "sweep", "--trace", str(sample_trace()), "--profile", "llama3-8b-h100"]) == 2
    assert "needs --workers" in capsys.readouterr().err



def test_sim_compares_policies_beside_the_offline_optimum_on_a_bursty_trace(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "bursty.jsonl"
    args = ["sim", "--synthetic", "bursty", "--requests", "30", "--save-trace", str(trace), "--profile",
            "llama3-8b-h100", "--burst-input-tokens", "4000,12000", "--policies", "none,predictive",
            "--no-progress", "--standard-ttft-ms", "2000", "--standard-tbt-ms", "150"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "% of optimum" in text and "offline optimum:" in text
    assert main([*args, "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["policies"]
    assert [r["policy"] for r in runs] == ["none", "predictive"]
    optimum = runs[0]["optimum"]
    assert optimum == {**runs[1]["optimum"], "pct_of_optimum": optimum["pct_of_optimum"],
                       "pct_of_best_schedule": optimum["pct_of_best_schedule"], "gap": optimum["gap"]}
    for r in runs:
        o = r["optimum"]
        assert o["method"] == "exact" and o["served"] >= r["slo_met"]
        assert o["pct_of_optimum"] == round(100 * r["slo_met"] / o["served"], 1)
    assert len(trace.read_text().splitlines()) == 30
