"""deploy/gpu_check.sh on a CPU machine: its syntax, and its dry run's plan (GPU_CHECK_DRY_RUN=1
runs nothing: every step takes its whole limit on a virtual clock), which must fit the 8-minute
budget with each phase inside its share."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from halfmoon.bench.gpu_summary import read_phases

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "gpu_check.sh"
SHARES = {"a": 38, "b": 17, "c": 30, "d": 15}

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def dry_run(tmp_path: Path, budget: int = 480) -> tuple[str, list[dict]]:
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1", "OUT": str(tmp_path), "GPU_CHECK_BUDGET_S": str(budget)}
    done = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout, read_phases(tmp_path)


def test_the_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, timeout=30).returncode == 0


def test_dry_run_runs_every_phase_within_the_budget(tmp_path: Path) -> None:
    out, steps = dry_run(tmp_path)
    assert "dry run: nothing is executed" in out
    assert [s["phase"] for s in steps] == ["a1", "a2", "a3", "b", "c1", "c2", "d"]
    assert sum(s["budget_s"] for s in steps) <= 480
    for phase, share in SHARES.items():
        own = sum(s["budget_s"] for s in steps if s["phase"].startswith(phase))
        assert own <= 480 * share // 100 + 1, f"phase {phase} takes {own}s, over its {share}% share"
    assert not list(tmp_path.glob("*.json")), "a dry run writes no results"


def test_each_step_names_what_it_runs(tmp_path: Path) -> None:
    out, _ = dry_run(tmp_path)
    assert re.search(r"== a1 .*test_cuda_graphs_match_eager_on_cuda .*"
                     r"test_cuda_verification_graphs_match_eager_on_cuda", out)
    assert re.search(r"== b .*bench\.gpu_serve_check", out)
    assert re.search(r"== c1 .*bench engine --device cuda --dtype bfloat16", out)
    assert re.search(r"== c2 .*transport_bench --skip throughput --device cuda", out)
    assert re.search(r"== d .*test_cuda_families\.py .*test_cuda_speculative_matches_plain_greedy", out)


def test_a_small_budget_skips_what_does_not_fit(tmp_path: Path) -> None:
    _, steps = dry_run(tmp_path, budget=200)
    skipped = [s["phase"] for s in steps if s["status"] == "skipped"]
    assert skipped and all(s["budget_s"] < 30 for s in steps if s["status"] == "skipped")
