"""LoRA adapters in the simulator: a trace's `adapter` key roots its own prefix chain (as live),
each prefill worker keeps an LRU of `max_loras` adapters and pays `adapter_load_ms` for one it does
not hold, the router prices that as the Conductor does, and the report counts it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from halfmoon.sim.cluster import SimConfig, simulate
from halfmoon.sim.conversations import conversation_trace
from halfmoon.sim.engines import AdapterSlots
from halfmoon.sim.report import render, summarize
from halfmoon.sim.trace import TraceError, parse_line
from halfmoon.sim.workload import build, load
from halfmoon.conductor.cost_model import CostModel

# a small GPU-like model: prefill 20 ms + 0.05 ms a token, decode steps 8 ms
COST = CostModel((20.0, 0.05, 0.0, 0.0), (8.0, 0.01, 0.0), 1e10, 100_000, "test: lora")


def _trace(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_same_hash_ids_under_two_adapters_are_different_blocks() -> None:
    rows = [parse_line(json.dumps({"timestamp": i, "input_length": 1100, "output_length": 4, "hash_ids": [1, 2, 3],
                                   **({"adapter": a} if a else {})}), i + 1)
            for i, a in enumerate(["a", "a", "b", None])]
    w = build(rows)
    assert w.requests[0].blocks == w.requests[1].blocks
    assert not set(w.requests[0].blocks) & set(w.requests[2].blocks)
    assert not set(w.requests[0].blocks) & set(w.requests[3].blocks)
    assert [r.adapter for r in w.requests] == ["a", "a", "b", ""]


def test_a_bad_adapter_key_names_its_line() -> None:
    with pytest.raises(TraceError, match=r"<trace>:3: adapter must be a string"):
        parse_line(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0],
                               "adapter": 7}), 3)


def test_slots_are_an_lru_that_charges_a_load_for_what_they_do_not_hold() -> None:
    slots = AdapterSlots(2, 50.0)
    assert [slots.use(a) for a in ["x", "y", "x", "z", "y", ""]] == [50.0, 50.0, 0.0, 50.0, 50.0, 0.0]
    assert (slots.loads, slots.evictions) == (4, 2)
    assert slots.holds("y") and slots.holds("z") and not slots.holds("x") and slots.holds("")


def test_fewer_slots_and_slower_loads_cost_ttft_and_the_report_counts_them(tmp_path: Path) -> None:
    rows = conversation_trace(120, seed=5, adapters=10, adapter_skew=0.5)
    assert len({r["adapter"] for r in rows}) > 4
    w = load(_trace(tmp_path, rows))
    cheap = simulate(w, SimConfig(prefill=2, decode=2, max_loras=16, adapter_load_ms=1.0), COST)
    dear = simulate(w, SimConfig(prefill=2, decode=2, max_loras=1, adapter_load_ms=500.0), COST)
    s_cheap, s_dear = summarize(cheap), summarize(dear)
    assert s_dear["adapters"]["evictions"] > 0 and s_cheap["adapters"]["evictions"] == 0
    assert s_dear["adapters"]["loads"] > s_cheap["adapters"]["loads"]
    assert s_dear["ttft_ms"]["p50"] > s_cheap["ttft_ms"]["p50"]
    assert sum(r["requests"] for r in s_dear["adapters"]["per_adapter"].values()) == 120
    assert "LoRA: " in render(s_dear) and "evictions" in render(s_dear)


def test_without_adapters_the_trace_and_the_report_are_as_before(tmp_path: Path) -> None:
    rows = conversation_trace(40, seed=5)
    assert rows == [{k: v for k, v in r.items() if k != "adapter"} for r in conversation_trace(40, seed=5, adapters=3)]
    result = simulate(load(_trace(tmp_path, rows)), SimConfig(prefill=1, decode=1), COST)
    assert "adapters" not in summarize(result)
