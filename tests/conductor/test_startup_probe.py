"""The per-request overhead measured at start (conductor/startup_probe.py): lone probes' TTFT
minus what the cost model gives them alone, the first probe dropped (it warms up), the median
of the rest; a failed probe leaves the model as it was. The backend here is a function that
answers with a TTFT (a real cluster is what `halfmoon serve` probes: tests/e2e)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from conductor.backend import GenerationInput
from conductor.cost_model import CostModel
from conductor.startup_probe import PROBE_SALT, lone_ttft_ms, measured_overhead, overhead_of
from core.messages import RequestEnd, Timings, TokenChunk, Usage
from core.params import FinishReason

# prefill: 1 ms a token; decode step: 50 ms
COST = CostModel((0.0, 1.0, 0.0, 0.0), (50.0, 0.0, 0.0), 1e9, 1, "test")


def test_the_overhead_is_the_median_past_the_first_probe() -> None:
    assert lone_ttft_ms(COST, 100, 20.0) == pytest.approx(20 + 100 + 50)
    probes = [(64, 5000.0), (64, 64 + 50 + 200), (128, 128 + 50 + 180), (256, 256 + 50 + 240)]
    assert overhead_of(COST, probes, 0.0) == pytest.approx(200.0)
    assert overhead_of(COST, [(64, 1.0), (64, 10.0)], 0.0) == 0.0  # faster than the model: none
    assert overhead_of(COST, [(64, 900.0)], 0.0) == 0.0  # only the warm-up: nothing measured


def test_probes_go_through_the_backend_and_set_the_models_overhead() -> None:
    seen: list[GenerationInput] = []

    async def generate(inp: GenerationInput) -> AsyncIterator[TokenChunk]:
        seen.append(inp)
        n = len(inp.prompt_ids)
        ttft = 1000.0 if len(seen) == 1 else lone_ttft_ms(COST, n, 20.0) + 150.0
        yield TokenChunk("p", [1], "x")
        yield TokenChunk("p", [2], "y", RequestEnd(FinishReason.LENGTH, None, Usage(n, 0, 2),
                                                   Timings(0.0, 1.0, 0.0, ttft, 1.0, ttft)))

    measured = asyncio.run(measured_overhead(generate, COST, 49152, 20.0, (64, 64, 128)))
    assert measured.overhead_ms == pytest.approx(150.0) and measured.prefill_coef == COST.prefill_coef
    assert [len(i.prompt_ids) for i in seen] == [64, 64, 128]
    assert {i.cache_salt for i in seen} == {PROBE_SALT} and seen[0].prompt_ids != seen[1].prompt_ids


def test_a_failed_probe_leaves_the_model_as_it_was() -> None:
    async def generate(inp: GenerationInput) -> AsyncIterator[TokenChunk]:
        raise RuntimeError("no worker")
        yield  # an async generator

    assert asyncio.run(measured_overhead(generate, COST, 49152, 20.0)) is COST
