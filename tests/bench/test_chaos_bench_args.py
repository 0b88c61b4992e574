"""`halfmoon bench chaos`'s standby options and its report (the bench itself runs servers: its
figures are in docs/BENCHMARKS.md)."""

from __future__ import annotations

import pytest

from halfmoon.bench.chaos_bench import parse_args, render


def test_standby_counts_parse_and_bad_ones_are_refused() -> None:
    assert parse_args(["--standby", "0,1"]).standbys == [0, 1]
    assert parse_args([]).standbys == [0]
    for bad in ("one", "-1"):
        with pytest.raises(SystemExit):
            parse_args(["--standby", bad])


def test_the_report_has_one_table_per_standby_count_and_the_standbys_memory() -> None:
    fault = {"fault": "decode", "errors": 0, "identical": "30/30", "longest_stall_s": 2.0,
             "serve_again_median_s": 1.42, "reprefilled_tokens": 445}
    result = {"streams": 6, "max_tokens": 48, "runs": 5, "clusters": [
        {"standby": 0, "faults": [dict(fault, serve_again_median_s=6.5)], "memory": None},
        {"standby": 1, "faults": [fault],
         "memory": {"decode-1": {"role": "decode", "state": "standby", "rss_mib": 2453.0, "uss_mib": 1809.0}}}]}
    text = render(result)
    assert text.index("--standby 0") < text.index("6.50") < text.index("--standby 1") < text.index("1.42")
    assert "decode-1 (decode, standby): RSS 2453 MiB, USS 1809 MiB" in text
