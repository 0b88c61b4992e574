"""What `halfmoon serve` measures at start (conductor/startup_probe.py): the per-request overhead
(lone probes' TTFT outside the window, their measured prefill and the first decode step; the
first probe dropped, the median of the rest) and the prefill worker's slowdown under load (a
burst's measured / modelled prefill, its first prefill dropped, the median, clamped to
[1, MAX_SCALE]); a failed probe leaves what it measures as it was. The backend here is a function that
answers with timings (a real cluster is what `halfmoon serve` probes: tests/e2e)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from halfmoon.conductor.backend import GenerationInput
from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.startup_probe import (
    BURST_MAX_TOKENS,
    MAX_SCALE,
    PROBE_SALT,
    measured_overhead,
    outside_prefill_ms,
    overhead_of,
    scale_of,
)
from halfmoon.core.messages import RequestEnd, Timings, TokenChunk, Usage
from halfmoon.core.params import FinishReason

# prefill: 1 ms a token; decode step: 50 ms
COST = CostModel((0.0, 1.0, 0.0, 0.0), (50.0, 0.0, 0.0), 1e9, 1, "test")


def timings(queue: float, prefill: float, ttft: float) -> Timings:
    return Timings(queue, prefill, 0.0, ttft, 1.0, ttft)


def test_the_overhead_is_what_a_lone_probe_spends_outside_prefill_and_the_first_step() -> None:
    assert outside_prefill_ms(COST, 100, timings(0, 130, 20 + 130 + 50 + 40), 20.0) == pytest.approx(40.0)
    assert outside_prefill_ms(COST, 100, timings(0, 0, 20 + 100 + 50 + 40), 20.0) == pytest.approx(40.0)  # model's prefill
    lone = [(64, timings(0, 900, 5000)), (64, timings(0, 70, 70 + 50 + 200)), (128, timings(0, 140, 140 + 50 + 180)),
            (256, timings(0, 300, 300 + 50 + 240))]
    assert overhead_of(COST, lone, 0.0) == pytest.approx(200.0)
    assert overhead_of(COST, [(64, timings(0, 64, 1)), (64, timings(0, 64, 10))], 0.0) == 0.0  # faster: none
    assert overhead_of(COST, [(64, timings(0, 64, 900))], 0.0) == 0.0  # only the warm-up: nothing measured


def test_the_scale_is_the_bursts_median_ratio_past_its_first_prefill() -> None:
    burst = [(100, timings(400, 150, 0)), (100, timings(0, 100, 0)), (200, timings(100, 260, 0)),
             (100, timings(300, 120, 0))]
    assert scale_of(COST, burst) == pytest.approx(1.3)  # 1.0 (queue 0) dropped: median of 1.3, 1.5, 1.2
    scaled = replace(COST, prefill_scale=1.3)
    assert scaled.est_prefill_ms(100) == pytest.approx(130.0)
    assert scale_of(scaled, burst) == pytest.approx(1.3)  # measured against the profile, not a scale set before
    assert scale_of(COST, [(100, timings(0, 100, 0)), (100, timings(1, 80, 0))]) == 1.0  # faster: never below 1
    assert scale_of(COST, [(100, timings(0, 100, 0)), (100, timings(1, 900, 0))]) == MAX_SCALE
    assert scale_of(COST, [(100, timings(0, 100, 0))]) == 1.0  # nothing past the first
    assert scale_of(COST, [(100, timings(0, 0, 0)), (100, timings(1, 0, 0))]) == 1.0  # no prefill measured


def test_probes_go_through_the_backend_and_set_the_models_overhead_and_scale() -> None:
    seen: list[GenerationInput] = []

    async def generate(inp: GenerationInput) -> AsyncIterator[TokenChunk]:
        seen.append(inp)
        n = len(inp.prompt_ids)
        burst = inp.params.max_tokens == BURST_MAX_TOKENS
        k = len(seen) - 4  # the burst's k-th (by arrival here)
        prefill = n * ((1.0 if k == 0 else 1.25) if burst else 1.1)  # its first prefills unloaded
        ttft = 1000.0 if len(seen) == 1 else 20.0 + prefill + 50.0 + 150.0
        yield TokenChunk("p", [1], "x")
        yield TokenChunk("p", [2], "y", RequestEnd(FinishReason.LENGTH, None, Usage(n, 0, 2),
                                                   timings(float(k), prefill, ttft)))

    measured = asyncio.run(measured_overhead(generate, COST, 49152, 20.0, (64, 64, 128), (96, 128, 160)))
    assert measured.overhead_ms == pytest.approx(150.0)
    assert measured.prefill_scale == pytest.approx(1.25) and measured.prefill_coef == COST.prefill_coef
    assert measured.est_prefill_ms(100) == pytest.approx(125.0)  # every prefill priced as loaded
    assert [len(i.prompt_ids) for i in seen] == [64, 64, 128, 96, 128, 160]
    assert {i.cache_salt for i in seen} == {PROBE_SALT} and seen[0].prompt_ids != seen[1].prompt_ids
    assert all(i.slo.ttft_ms and i.slo.ttft_ms >= 60_000 for i in seen[3:])  # the burst is never refused


def test_a_failed_probe_leaves_the_model_as_it_was() -> None:
    async def generate(inp: GenerationInput) -> AsyncIterator[TokenChunk]:
        raise RuntimeError("no worker")
        yield  # an async generator

    assert asyncio.run(measured_overhead(generate, COST, 49152, 20.0)) == COST


def test_burst_probes_the_decode_pool_cannot_hold_at_once_leave_the_rest_measured() -> None:
    """A small decode pool (live: four 0.015 GiB workers, 43 blocks each) holds only some of the
    burst at once: the refused probes are left out; the overhead the lone probes measured and
    the scale of the burst probes that ran both stand (they were both dropped, issue 49)."""
    calls = [0]

    async def generate(inp: GenerationInput) -> AsyncIterator[TokenChunk]:
        calls[0] += 1
        n = len(inp.prompt_ids)
        burst = inp.params.max_tokens == BURST_MAX_TOKENS
        if burst and n > 128:
            raise RuntimeError("no live decode worker has 19 free KV blocks")
        k = calls[0] - 4
        prefill = n * ((1.0 if k == 0 else 1.5) if burst else 1.0)
        ttft = 20.0 + prefill + 50.0 + 100.0
        yield TokenChunk("p", [2], "y", RequestEnd(FinishReason.LENGTH, None, Usage(n, 0, 2),
                                                   timings(float(k), prefill, ttft)))

    measured = asyncio.run(measured_overhead(generate, COST, 49152, 20.0, (64, 64, 128), (64, 96, 128, 160, 192)))
    assert measured.overhead_ms == pytest.approx(100.0)
    assert measured.prefill_scale == pytest.approx(1.5)  # 96 and 128 (64 ran first, unloaded)
