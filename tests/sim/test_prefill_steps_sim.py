"""The simulated prefill worker steps its queue as the engine's scheduler does (conductor/
prefill_steps.py, the rule the Conductor's ledger predicts with): a burst's prompts in one step
get their first tokens together; serve's one prompt a step serves them shortest first; the
per-request overhead a cost model carries is the simulator's by default (issue 38)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from halfmoon.conductor.admission import AdmissionConfig
from halfmoon.conductor.cost_model import CostModel
from halfmoon.sim.cluster import SimConfig, SimResult, simulate
from halfmoon.sim.trace import parse_line
from halfmoon.sim.workload import Workload, build

# prefill: 20 ms a step + 1 ms a token; decode step: 10 ms + 1 ms a request (SLOs out of reach)
COST = CostModel((20.0, 1.0, 0.0, 0.0), (10.0, 1.0, 0.0), 2e9, 1000, "test")
WINDOW = AdmissionConfig(admit_window_ms=20.0)


def burst(*prompts: int) -> Workload:
    """Requests arriving together (ids distinct: no shared prefix), 4 output tokens each."""
    rows = [{"timestamp": 0, "input_length": n, "output_length": 4, "hash_ids": [10 * i + 1]}
            for i, n in enumerate(prompts)]
    return build(parse_line(json.dumps(r), i + 1) for i, r in enumerate(rows))


def run(workload: Workload, cost: CostModel = COST, **changes: object) -> SimResult:
    return simulate(workload, replace(SimConfig(), admission=WINDOW, **changes), cost)  # type: ignore[arg-type]


def ttft_ms(result: SimResult) -> dict[int, float]:
    return {r.prompt_len: r.ttft_s * 1e3 for r in result.records if r.ttft_s is not None}


def test_a_batched_step_gives_its_prompts_their_first_tokens_together() -> None:
    result = run(burst(300, 100, 200, 150), prefill_max_seqs=None)
    got = ttft_ms(result)
    # the window decides 100, 150, 200, 300: 100 alone (it found the worker idle), then one step
    # of the rest (512 tokens: 300's last 138 in a third step)
    first = 20 + 20 + 100  # the window's hold, then 100's step
    assert got[100] == pytest.approx(first + 11, abs=0.1)  # + its first decode step
    assert got[150] == pytest.approx(first + 20 + 512 + 11, abs=0.1)
    assert 0 < got[200] - got[150] <= 13  # the same step's end: 200 joins decode a step later
    assert got[300] > got[200]
    last = next(r for r in result.records if r.prompt_len == 300)
    assert last.predicted_ttft_ms == pytest.approx(got[300], rel=0.01)  # decided last: it saw every step


def test_one_prompt_a_step_serves_the_window_shortest_first_as_predicted() -> None:
    result = run(burst(300, 100, 200, 150))
    assert SimConfig().prefill_max_seqs == 1  # serve's default
    got = ttft_ms(result)
    assert got[100] < got[150] < got[200] < got[300]
    for r in result.records:
        assert r.predicted_ttft_ms == pytest.approx(r.ttft_s * 1e3, rel=0.01)


def test_the_cost_models_overhead_is_the_simulators_by_default() -> None:
    slow = replace(COST, overhead_ms=150.0)
    alone, with_overhead = run(burst(100)), run(burst(100), slow)
    assert with_overhead.config.overhead_ms == 150.0 and alone.config.overhead_ms == 0.0
    assert ttft_ms(with_overhead)[100] == pytest.approx(ttft_ms(alone)[100] + 150.0)
    record = with_overhead.records[0]
    assert record.predicted_ttft_ms == pytest.approx(record.ttft_s * 1e3, rel=0.01)  # admission adds it too
    assert run(burst(100), slow, overhead_ms=0.0).config.overhead_ms == 0.0  # a flag still overrides it
