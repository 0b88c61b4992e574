"""`halfmoon bench first-run`'s table and its reading of the server's log (the starts themselves
run in tests/e2e/test_first_run.py, from an empty cache folder)."""

from __future__ import annotations

import pytest

from halfmoon.bench.first_run_bench import Start, _seconds, main, render


def test_the_log_lines_it_reads_are_the_ones_serve_writes() -> None:
    log = ("no cost model given and none cached ...\nquick profile: 100%|##| 14/14\nprofiled in 8.0 s\n"
           "first use of gemma3-270m: assembling it ...\nassembled gemma3-270m in 1.7 s\n")
    assert _seconds(r"profiled in ([\d.]+) s", log) == 8.0
    assert _seconds(r"assembled \S+ in ([\d.]+) s", log) == 1.7
    assert _seconds(r"profiled in ([\d.]+) s", "cost model from the profile cache") is None


def test_the_table_shows_cold_against_warm_and_a_missed_target() -> None:
    rows = [Start("(defaults)", "cold", 30.0, 34.7, 8.0, None), Start("(defaults)", "warm", 20.0, 21.0, None, None),
            Start("--model gemma3-270m", "cold", 80.0, 90.0, 61.0, 1.7),
            Start("--model gemma3-270m", "warm", 30.0, 30.0, None, None)]
    out = render(rows)
    assert "| (defaults) | cold | 30.0 | 34.7 | 8.0 | - |" in out
    assert "61.0 MISSED" in out and "| 1.7 |" in out
    assert "(defaults): first run 34.7 s to the first answer, 1.65x a warm start (21.0 s)" in out


def test_bad_flags_exit_2() -> None:
    with pytest.raises(SystemExit) as e:
        main(["--no-such-flag"])
    assert e.value.code == 2
