"""`halfmoon bench dashboard` end to end on a small co-located server: both modes replayed, the
pollers' endpoint latencies measured and summarised."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.support import cost_model_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_dashboard_bench_replays_without_and_with_pollers(tmp_path: Path) -> None:
    serve = f"--colocated --threads 1 --num-blocks 128 --no-redis --admission none --cost-model {cost_model_file(tmp_path / 'c.json')}"
    proc = subprocess.run(
        [sys.executable, "-m", "halfmoon.cli.main", "bench", "dashboard", "--serve-args", serve, "--rate", "1",
         "--duration", "4", "--pairs", "1", "--pollers", "1", "--poll-s", "0.2", "--max-output-tokens", "4",
         "--ttft-slo-ms", "60000", "--tbt-slo-ms", "60000", "--no-progress", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "without / with dashboards polling" in proc.stdout and "endpoints within bound" in proc.stdout
    result = json.loads((tmp_path / "dashboard_bench.json").read_text())
    assert [r["watched"] for r in result["runs"]] == [False, True]
    assert all(r["metrics"]["completed"] == r["metrics"]["requests"] > 0 for r in result["runs"])
    assert result["runs"][0]["endpoints_ms"] == {}
    live = result["runs"][1]["endpoints_ms"]["/dashboard/api/live"]
    assert live["n"] >= 5 and 0 < live["p50"] <= live["p99"] <= live["max"]
    s = result["summary"]
    assert s["ratio_with_over_without"]["goodput_rps"] is not None
    assert s["endpoints_met"] in (True, False)
