"""The simulator runs the Conductor's admission window (conductor/admission_window.py): on a
bursty replay a window serves the bursts' short prompts, near the offline optimum, where
deciding each request as it arrives serves the first ones (deterministic: simulated time)."""

from __future__ import annotations

import json
from dataclasses import replace

from halfmoon.conductor.admission import AdmissionConfig
from halfmoon.conductor.cost_model import CostModel
from halfmoon.sim.bursts import bursty_trace
from halfmoon.sim.cluster import SimConfig, simulate
from halfmoon.sim.optimum_jobs import sim_optimum
from halfmoon.sim.report import summarize
from halfmoon.sim.trace import parse_line
from halfmoon.sim.workload import build

# this machine's quick profile of SmolLM2 fp32, one thread (docs/BENCHMARKS.md, issue 38)
CPU = CostModel((34.97, 1.98, 0.00378, 0.000949), (45.23, 0.405, 0.00912), 2e9, 46080, "test: CPU fp32")


def replay(window_ms: float, seed: int = 0) -> dict:
    rows = bursty_trace(60, seed=seed)
    workload = build(parse_line(json.dumps(r), i + 1) for i, r in enumerate(rows))
    config = replace(SimConfig(), admission=AdmissionConfig(admit_window_ms=window_ms))
    result = simulate(workload, config, CPU)
    return summarize(result, sim_optimum(result, CPU))


def test_a_window_serves_a_bursty_replay_near_the_optimum() -> None:
    fcfs, window = replay(0.0), replay(20.0)
    optimum = window["optimum"]["served"]
    assert optimum == fcfs["optimum"]["served"] == 20  # the same arrivals: one optimum
    assert fcfs["slo_met"] <= 11  # the first of each burst, then the queue is full
    assert window["slo_met"] >= 0.85 * optimum
    assert window["admitted_ok_pct"] >= 90.0
