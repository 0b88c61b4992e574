"""Synthetic bursty traces (sim/bursts.py): bursts of the asked size arriving together, valid
Mooncake rows the trace reader accepts, the same for the same seed."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from halfmoon.sim.bursts import BurstShape, bursty_trace
from halfmoon.sim.conversations import write_trace
from halfmoon.sim.trace import read_trace


def test_bursts_arrive_together_in_the_asked_sizes_and_gaps(tmp_path: Path) -> None:
    rows = bursty_trace(200, seed=3)
    assert rows == bursty_trace(200, seed=3) and rows != bursty_trace(200, seed=4)
    sizes = Counter(r["timestamp"] for r in rows)
    starts = sorted(sizes)
    assert all(10 <= sizes[t] <= 16 for t in starts[:-1])  # the last burst is cut at 200 requests
    assert all(10_000 <= b - a <= 20_000 for a, b in zip(starts, starts[1:]))
    assert all(64 <= r["input_length"] <= 512 and 16 <= r["output_length"] <= 128 for r in rows)
    ids = [h for r in rows for h in r["hash_ids"]]
    assert len(ids) == len(set(ids))  # no prefix shared
    assert len(list(read_trace(write_trace(rows, tmp_path / "b.jsonl")))) == 200


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="size"):
        BurstShape(size=(16, 10))
    with pytest.raises(ValueError, match=">= 1"):
        BurstShape(size=(0, 4))
