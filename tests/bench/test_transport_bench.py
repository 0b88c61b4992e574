"""`halfmoon bench transport`: the report's parsing and a tiny real run (tcp, one size)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from halfmoon.bench.transport_bench import MB, parse_perftest

# The client's summary line as ucx_perftest 1.21 prints it (columns: iterations, p50 latency,
# average latency, overall latency, average MB/s, overall MB/s, average msg/s, overall msg/s).
PERFTEST_OUT = """\
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
Final:                     4      4.987  5637.765  5637.765      177.38     177.38         177         177
"""


def test_parse_perftest_reads_the_average_bandwidth() -> None:
    assert parse_perftest(PERFTEST_OUT) == pytest.approx(177.38 * MB / 1e9)
    assert "no Final" in parse_perftest("ucx_perftest: error\n")


def test_tiny_tcp_run_reports_ratio_and_target() -> None:
    proc = subprocess.run([sys.executable, "-m", "halfmoon.cli.main", "bench", "transport", "--backends", "tcp",
                           "--sizes-mb", "1,8", "--rounds", "1", "--budget-mb", "16", "--skip", "pipelining",
                           "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["throughput"]
    assert [(r["backend"], r["size_mb"]) for r in rows] == [("tcp", 1), ("tcp", 8)]
    for r in rows:
        assert r["gbps"] > 0 and r["raw_gbps"] > 0 and r["ratio"] == pytest.approx(r["gbps"] / r["raw_gbps"])
    assert rows[0]["target"] is None and rows[1]["target"] == 0.70  # the target applies from 8 MB


def test_rounds_keep_the_best_per_size_and_an_error_sticks() -> None:
    from halfmoon.bench.transport_bench import _best

    acc = _best({}, {8: 1.0, 64: 3.0})
    acc = _best(acc, {8: 2.0, 64: 2.5})
    assert acc == {8: 2.0, 64: 3.0}
    assert _best(acc, "ucx_perftest not found") == "ucx_perftest not found"
    assert _best("ucx_perftest failed", {8: 9.0}) == "ucx_perftest failed"


def test_ucxx_run_prints_both_perftest_baselines() -> None:
    """One small real ucxx point: the like-for-like baseline (perftest -e), the plain one and
    the checksummed channel's ceiling."""
    proc = subprocess.run([sys.executable, "-m", "halfmoon.cli.main", "bench", "transport", "--backends", "ucxx",
                           "--ucx-tls", "tcp", "--sizes-mb", "8", "--rounds", "1", "--budget-mb", "16",
                           "--skip", "pipelining", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)["throughput"]
    assert row["backend"] == "ucxx (tcp)" and row["baseline"] == "ucx_perftest -e tcp"
    assert row["gbps"] > 0 and row["raw_gbps"] > 0 and row["plain_gbps"] > 0 and row["channel_gbps"] > 0
    assert row["bare_channel_gbps"] > 0
    assert row["ratio"] == pytest.approx(row["gbps"] / row["raw_gbps"])
    # Each round's own ratio (backend and perftest back to back): one per round.
    assert len(row["round_ratios"]) == 1 and row["round_ratios"][0] == pytest.approx(row["ratio"], rel=1e-3)


def test_the_channel_references_run_to_the_end() -> None:
    """The references' peers, with checksums on and off, for a size that is not a whole number
    of frames: the receiver acks only once every frame of every unit landed (a frame short and
    the sender would wait for the ack until its timeout), and both exit cleanly."""
    from halfmoon.bench.transport_bench import Peer

    for flags in ([], ["--no-hash"]):
        receiver = Peer(["chan", "--nbytes", str(9 * MB + 123), "--count", "3", *flags], {"UCX_TLS": "tcp"})
        try:
            sender = Peer(["chansend", "--address", receiver.first["address"], "--nbytes", str(9 * MB + 123),
                           "--count", "3", *flags], {"UCX_TLS": "tcp"})
            assert sender.first["gbps"] > 0
            assert sender.proc.wait(30) == 0
        finally:
            receiver.close()
        assert receiver.proc.returncode == 0
