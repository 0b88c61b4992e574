"""The per-request overhead, measured when `halfmoon serve` starts: lone probe requests through
the real path (admission window, decode reservation, prefill RPC, KV handoff, decode join,
streaming back), so the first burst is not predicted cold (issue 38).

The cost model times engines alone. A live 1P1D cluster's first burst measured 2-3x what
admission predicted: 130-280 ms per request of RPCs, KV handoff and streaming were in no
prediction until the online calibration (conductor/calibration.py) had finished requests to fit.
Each probe's overhead is its measured TTFT minus what the cost model gives it on idle workers
(`lone_ttft_ms`: the window's hold, its prefill, the first decode step); the first probe also
pays one-time costs (first forward passes, connections) and is dropped; `CostModel.overhead_ms`
is the median of the rest. Admission adds it to every predicted TTFT, and the simulator to every
request's handoff (the model `GET /dashboard/api/cost-model` serves carries it). The online
calibration still fits what is left.

Probes use random token ids under their own cache salt: no tenant's prefix cache sees them.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

import numpy as np

from conductor.backend import GenerationInput
from conductor.cost_model import CostModel
from core.messages import TokenChunk
from core.params import SamplingParams

log = logging.getLogger(__name__)

PROBE_PROMPTS = (64, 64, 128, 256, 128)  # tokens of each lone probe; the first only warms up
PROBE_SALT = "halfmoon-overhead-probe"
PROBE_MAX_TOKENS = 2

Generate = Callable[[GenerationInput], AsyncIterator[TokenChunk]]


def lone_ttft_ms(cost: CostModel, prompt_tokens: int, window_ms: float) -> float:
    """What the cost model gives a lone request's TTFT on idle workers, without the overhead."""
    return window_ms + cost.est_prefill_ms(prompt_tokens) + cost.est_decode_step_ms(1, prompt_tokens)


def overhead_of(cost: CostModel, measured: Sequence[tuple[int, float]], window_ms: float) -> float:
    """The median of measured - modelled TTFT over `(prompt tokens, measured TTFT ms)` probes,
    the first dropped (it warms up); never negative. 0 with no probe left."""
    kept = measured[1:]
    if not kept:
        return 0.0
    return max(0.0, statistics.median(ttft - lone_ttft_ms(cost, n, window_ms) for n, ttft in kept))


async def probe_ttft_ms(generate: Generate, prompt_tokens: int, vocab_size: int, seed: int) -> float:
    """One lone probe's TTFT as the Conductor measured it (ms)."""
    ids = np.random.default_rng(seed).integers(16, max(17, vocab_size), size=prompt_tokens).tolist()
    inp = GenerationInput(ids, SamplingParams(max_tokens=PROBE_MAX_TOKENS, ignore_eos=True),
                          request_id=f"overhead-probe-{seed}", cache_salt=PROBE_SALT)
    async for chunk in generate(inp):
        if chunk.end is not None:
            return chunk.end.timings.ttft_ms
    raise RuntimeError("the probe's stream ended without a result")


async def measured_overhead(generate: Generate, cost: CostModel, vocab_size: int, window_ms: float,
                            prompts: Sequence[int] = PROBE_PROMPTS) -> CostModel:
    """`cost` with `overhead_ms` measured by lone probes through `generate` (one at a time); a
    probe that fails leaves the model as it was (logged)."""
    measured: list[tuple[int, float]] = []
    try:
        for i, n in enumerate(prompts):
            measured.append((n, await probe_ttft_ms(generate, n, vocab_size, seed=i)))
    except Exception as e:  # a start-up measurement: the server runs without it
        log.warning("per-request overhead probe failed (%s); predicting without it", e)
        return cost
    overhead = overhead_of(cost, measured, window_ms)
    log.info("per-request overhead %.0f ms (lone probes' TTFT %s ms; the cost model's overhead_ms)", overhead,
             ", ".join(f"{t:.0f}" for _, t in measured))
    return replace(cost, overhead_ms=overhead)
