"""What a request costs outside the profile, measured when `halfmoon serve` starts (issue 38):
the per-request overhead, with lone probe requests, and the prefill worker's slowdown under
load, with a burst of them; both through the real path (admission window, decode reservation,
prefill RPC, KV handoff, decode join, streaming back), so the first burst is not predicted cold.

The cost model times engines alone. A live 1P1D cluster's first burst measured 2-3x what
admission predicted: 130-280 ms per request of RPCs, KV handoff and streaming were in no
prediction until the online calibration (conductor/calibration.py) had finished requests to fit.
Each lone probe's overhead is its measured TTFT less the window's hold, its prefill as the
prefill worker measured it and the model's first decode step (`outside_prefill_ms`); the first
probe also pays one-time costs (first forward passes, connections) and is dropped;
`CostModel.overhead_ms` is the median of the rest.

Then a burst: `BURST_PROMPTS` sent at once, each decoding `BURST_MAX_TOKENS`, so from the second
on a prompt prefills while the decode worker steps the earlier ones, as in a burst of traffic.
On workers that share cores (this CPU's 1P1D) a burst's prefills measured 1.1-1.2x their
profile at start (the profile times the engine alone; the worker also streams the KV out layer
by layer and shares the cores with the decode worker and the Conductor). `CostModel.
prefill_scale` is the median over the burst (its first prefill, unloaded, dropped) of measured /
modelled prefill time, clamped to [1, `MAX_SCALE`]. It prices every prefill as loaded. What it
cannot see: the probes skip the gRPC front door, so the streaming of many decoding requests'
tokens to clients, which slowed live prefills to 1.4-1.7x the profile beside ten decoding
requests (docs/BENCHMARKS.md, issue 38), is left to the online calibration.

Admission adds the overhead to every predicted TTFT and scales every prefill; the simulator and
the offline optimum read both from the model `GET /dashboard/api/cost-model` serves. The online
calibration still fits what is left.

Probes use random token ids under their own cache salt: no tenant's prefix cache sees them. The
burst asks for a loose SLO of its own (`BURST_SLO`), so admission never refuses it.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import replace

import numpy as np

from halfmoon.conductor.backend import GenerationInput, Slo
from halfmoon.conductor.cost_model import CostModel
from halfmoon.core.messages import Timings, TokenChunk
from halfmoon.core.params import SamplingParams

log = logging.getLogger(__name__)

PROBE_PROMPTS = (64, 64, 128, 256, 128)  # tokens of each lone probe; the first only warms up
PROBE_SALT = "halfmoon-overhead-probe"
PROBE_MAX_TOKENS = 2
BURST_PROMPTS = (96, 128, 160, 192, 224, 256)  # sent together; the first prefills unloaded
BURST_MAX_TOKENS = 48  # enough decode steps to overlap every later prefill of the burst
BURST_SLO = Slo(ttft_ms=120_000.0, tbt_ms=120_000.0)
MAX_SCALE = 3.0
NO_SLO = Slo()  # the class's objectives

Generate = Callable[[GenerationInput], AsyncIterator[TokenChunk]]


def outside_prefill_ms(cost: CostModel, prompt_tokens: int, timings: Timings, window_ms: float) -> float:
    """What a lone probe's TTFT spent outside the window's hold, its prefill (as the prefill
    worker measured it; the model's where it measured none) and the first decode step."""
    prefill = timings.prefill_ms or cost.est_prefill_ms(prompt_tokens)
    return timings.ttft_ms - window_ms - prefill - cost.est_decode_step_ms(1, prompt_tokens)


def overhead_of(cost: CostModel, lone: Sequence[tuple[int, Timings]], window_ms: float) -> float:
    """The median of `outside_prefill_ms` over `(prompt tokens, timings)` lone probes, the first
    dropped (it warms up); never negative. 0 with no probe left."""
    kept = lone[1:]
    if not kept:
        return 0.0
    return max(0.0, statistics.median(outside_prefill_ms(cost, n, t, window_ms) for n, t in kept))


def scale_of(cost: CostModel, burst: Sequence[tuple[int, Timings]]) -> float:
    """`CostModel.prefill_scale`: the median of measured / modelled (the profile's, unscaled)
    prefill time over a burst's `(prompt tokens, timings)`, its first prefill (by queue time:
    nothing decoded beside it) dropped, clamped to [1, MAX_SCALE]; 1 when none measured one."""
    plain = replace(cost, prefill_scale=1.0)
    loaded = sorted(burst, key=lambda p: p[1].queue_ms)[1:]
    ratios = [t.prefill_ms / plain.est_prefill_ms(n) for n, t in loaded if t.prefill_ms > 0 and n > 0]
    return min(MAX_SCALE, max(1.0, statistics.median(ratios))) if ratios else 1.0


async def probe(generate: Generate, prompt_tokens: int, vocab_size: int, seed: int,
                max_tokens: int = PROBE_MAX_TOKENS, slo: Slo = NO_SLO) -> Timings:
    """One probe's timings as the Conductor measured them."""
    ids = np.random.default_rng(seed).integers(16, max(17, vocab_size), size=prompt_tokens).tolist()
    inp = GenerationInput(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                          request_id=f"overhead-probe-{seed}", cache_salt=PROBE_SALT, slo=slo)
    async for chunk in generate(inp):
        if chunk.end is not None:
            return chunk.end.timings
    raise RuntimeError("the probe's stream ended without a result")


async def measured_overhead(generate: Generate, cost: CostModel, vocab_size: int, window_ms: float,
                            prompts: Sequence[int] = PROBE_PROMPTS,
                            burst: Sequence[int] = BURST_PROMPTS) -> CostModel:
    """`cost` with `overhead_ms` measured by lone probes through `generate` (one at a time) and
    `prefill_scale` by a burst of them (none when `burst` is empty). Each measured on its own: a
    lone probe that fails leaves the overhead unmeasured, burst probes refused (a decode pool
    too small for them all at once: its KV is booked exactly) are left out of the scale; logged."""
    try:
        lone = [(n, await probe(generate, n, vocab_size, seed=i)) for i, n in enumerate(prompts)]
    except Exception as e:  # a start-up measurement: the server runs without it
        log.warning("start-up probes failed (%s); predicting without the per-request overhead they measure", e)
        lone = []
    answers = await asyncio.gather(*(probe(generate, n, vocab_size, seed=1000 + i, max_tokens=BURST_MAX_TOKENS,
                                           slo=BURST_SLO) for i, n in enumerate(burst)), return_exceptions=True)
    loaded = [(n, t) for n, t in zip(burst, answers, strict=True) if not isinstance(t, BaseException)]
    refused = [t for t in answers if isinstance(t, BaseException)]
    if refused:
        log.warning("%d of %d burst probes failed (first: %s); the prefill slowdown is measured on the %d left",
                    len(refused), len(answers), refused[0], len(loaded))
    overhead, scale = overhead_of(cost, lone, window_ms), scale_of(cost, loaded)
    log.info("per-request overhead %.0f ms (lone probes' TTFT %s ms, prefill %s ms); prefill under load x%.2f "
             "the profile (a burst: prefill %s ms)", overhead, _ms(t.ttft_ms for _, t in lone),
             _ms(t.prefill_ms for _, t in lone), scale, _ms(t.prefill_ms for _, t in loaded))
    return replace(cost, overhead_ms=overhead, prefill_scale=scale)


def _ms(values: Iterable[float]) -> str:
    return ", ".join(f"{v:.0f}" for v in values)
