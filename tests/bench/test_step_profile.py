"""bench/step_profile.py's KernelClock: a step's kernels timed without the profiler, then put back."""

from __future__ import annotations

from halfmoon.kernels import fused as kernels_fused
from halfmoon.kernels import torch_backend as kernels_torch
from halfmoon.bench.step_profile import KernelClock, decode_step_profile
from halfmoon.core.params import SamplingParams
from halfmoon.engine.engine import Engine


def _kernels(engine: Engine) -> list[object]:
    model = engine.model
    layers = [getattr(lw, n) for lw in model.layers for n in ("qkv", "o", "gate_up", "down")]
    return [*layers, model.lm_head, kernels_fused._fused, kernels_fused._paged_attn,
            kernels_torch._paged_attn]


def test_the_clock_times_a_steps_kernels_and_puts_them_back(engine: Engine) -> None:
    before = _kernels(engine)
    engine.add_request(list(range(100, 140)), SamplingParams(max_tokens=6, ignore_eos=True), request_id="clock")
    engine.step()  # the prefill
    with KernelClock(engine.model) as clock:
        assert all(a is not b for a, b in zip(before[:-3], _kernels(engine)[:-3])), "layers not wrapped"
        start = clock.total_s
        engine.step()  # a decode step: every layer's four products, the head, the native calls
        timed = clock.total_s - start
    assert timed > 0
    assert all(a is b for a, b in zip(before, _kernels(engine))), "a kernel was not put back"
    while engine.has_unfinished():
        engine.step()


def test_the_profile_reports_the_glue_between_its_bounds(engine: Engine) -> None:
    prof = decode_step_profile(engine, list(range(200, 264)), steps=12)
    glue = prof["python + scheduling (timed kernels)"]
    assert 0 < glue < prof["step (wall)"]
    assert glue >= prof["per-step overhead (outside the forward)"] * 0.5
    # every pass (timed, glue, profiled) decodes: the request outlives all three
    assert prof["step (wall, profiled)"] > 0.5 * prof["step (wall)"]
    assert prof["linear (weights)"] > 0
