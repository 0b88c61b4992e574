"""`halfmoon sim` and `halfmoon sim sweep` end to end: output, files, and Helm values the chart's
schema accepts."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from dataclasses import replace

from halfmoon.cli.main import main
from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.serve_defaults import tier_tokens
from halfmoon.engine.config import EngineConfig
from halfmoon.sim import builtin
from halfmoon.sim.builtin import load as load_profile
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
    (["--workers", "1"], "budget of >= 2 devices"),
    (["--tp-cost-model", "two=x.json"], "--tp-cost-model takes TP=FILE"),
    (["--device-tokens", "lots"], "--device-tokens takes integers"),
])
def test_bad_sweep_arguments_are_named(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["sim", "sweep", "--trace", str(sample_trace()), "--profile", "llama3-8b-h100", "--workers", "2", *extra]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_sweep_over_layouts_recommends_a_layout_and_split_from_a_profile_per_tp(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--tp-cost-model 2=FILE`: every (prefill tp, decode tp) over {1, 2}, each P:D split of 4
    devices. The TP=2 profile here is the A100 one with decode steps 1.6x and prefill 1.8x as
    fast (a stand-in for a measured `halfmoon profile --tp 2`): the sweep's arithmetic, not a
    claim about the hardware."""
    base = CostModel.load(Path(builtin.PROFILES / "llama3-8b-a100.json"))
    tp2 = replace(base, prefill_coef=tuple(c / 1.8 for c in base.prefill_coef),
                  decode_coef=tuple(c / 1.6 for c in base.decode_coef), source="test: tp2 stand-in")
    tp2.save(tmp_path / "tp2.json")
    args = ["sim", "sweep", "--trace", str(sample_trace()), "--profile", "llama3-8b-a100", "--workers", "4",
            "--tp-cost-model", f"2={tmp_path / 'tp2.json'}", "--device-tokens", "65536", "--host-tokens", "0,200000",
            "--speed", "4", "--out", str(tmp_path), "--json", "--no-progress", *SLO]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["rows"]
    layouts = {(r["prefill_tp"], r["decode_tp"]) for r in rows}
    assert layouts == {(1, 1), (1, 2), (2, 1), (2, 2)}
    for r in rows:  # the budget: P x tp_p + D x tp_d devices at most, every worker whole
        assert r["devices"] == r["prefill"] * r["prefill_tp"] + r["decode"] * r["decode_tp"] <= 4
        assert r["host_tokens"] == 0 or (r["prefill_tp"], r["decode_tp"]) == (1, 1)
    # 1:1 {1P3D, 2P2D, 3P1D} x host; 1:2 {1P1D (3 devices), 2P1D}; 2:1 {1P2D}; 2:2 {1P1D}
    assert len(rows) == 3 * 2 + 2 + 1 + 1
    best = result["best"]
    assert best["goodput_per_device"] == max(r["goodput_per_device"] for r in rows)
    snippet = yaml.safe_load((tmp_path / "values.yaml").read_text())
    assert (snippet["prefill"]["tp"], snippet["decode"]["tp"]) == (best["prefill_tp"], best["decode_tp"])
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator(schema).validate(drop_nulls(merge(yaml.safe_load((CHART / "values.yaml").read_text()),
                                                                 snippet)))


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
