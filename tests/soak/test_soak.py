"""`halfmoon bench soak` in the suite: a short run (about a minute of load, one fault of a few
kinds) that must hold what the long soak holds — no client-visible errors, greedy streams
identical to the undisturbed run, no leaked blocks or leases, /health, /metrics and the dashboard
agreeing with the integrity checks; and the long one behind the `soak` marker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from halfmoon.bench import soak_bench, soak_faults

SHORT = ["--minutes", "0.8", "--requests", "12", "--rps", "1.5", "--max-tokens", "12",
         "--kinds", "kill-decode,kv-drop,enospc"]


def test_the_schedule_is_seeded_and_spreads_every_kind() -> None:
    a = soak_faults.schedule(soak_faults.KINDS, 30, seed=5, warm_up_s=30)
    assert a == soak_faults.schedule(soak_faults.KINDS, 30, seed=5, warm_up_s=30)
    assert a != soak_faults.schedule(soak_faults.KINDS, 30, seed=6, warm_up_s=30)
    assert all(sum(f.kind == k for f in a) >= 12 for k in soak_faults.KINDS)
    times = [f.at_s for f in a]
    assert times == sorted(times) and 30 <= times[0] and times[-1] <= 30 * 60 * 0.9


def test_unknown_fault_kinds_and_bad_numbers_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--kinds", "kill-everything"], ["--minutes", "0"], ["--rps", "-1"]):
        with pytest.raises(SystemExit):
            soak_bench.parse_args(argv)
    assert "kill-everything" in capsys.readouterr().err
    assert soak_bench.parse_args(["--faults", "none"]).kind_list == ()


@pytest.mark.slow
def test_a_short_soak_holds(tmp_path: Path) -> None:
    code = soak_bench.main([*SHORT, "--out", str(tmp_path), "--plot", str(tmp_path / "timeline.png")])
    result = json.loads((tmp_path / "soak_bench.json").read_text())
    assert sum(result["fault_counts"].values()) == 3, result["fault_counts"]
    assert all(f["struck_s"] is not None and f["recovered_s"] is not None for f in result["faults"]), result["faults"]
    assert result["compared"] > 0 and result["mismatches"] == 0
    assert not [k for k in result["counts"] if k.startswith("error")], result["error_samples"]
    assert all(c["ok"] for c in result["integrity"].values()), result["integrity"]
    assert not any(result["leases"].values()) and result["agreement"]["agree"], result["agreement"]
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    assert code == 0, result["failed"]


@pytest.mark.soak
def test_the_long_soak_holds(tmp_path: Path) -> None:
    code = soak_bench.main(["--minutes", "30", "--faults", "random", "--out", str(tmp_path)])
    assert code == 0, json.loads((tmp_path / "soak_bench.json").read_text())["failed"]
