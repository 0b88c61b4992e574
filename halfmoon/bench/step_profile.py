"""Where one decode step's time goes: torch profiler over real engine steps, ops grouped.

Used by `halfmoon bench engine` to back the roofline line with a breakdown. Two passes over the
same request's decode steps:

    unprofiled:  | step wall                                                              |
                 | outside the forward (scheduler, runner, sampler, detokenizer) | forward |
    profiled:    ops by category (torch profiler self time, the native attention call included)

`python + scheduling` = unprofiled step wall - the profiled ops: the Python glue between ops,
torch's dispatch and everything outside the forward. The profiler records every op and its
nested ops, and part of that cost lands in the ops' self time, so this figure is a lower bound
(0 when the inflation exceeds it, as it does for bf16 on an AVX2 CPU); `python + scheduling
(profiled)` = profiled wall - ops is the upper bound (the figure this line used to print).
`per-step overhead (outside the forward)` is measured directly, without the profiler: step wall
minus the forward's wall (the runner times its forward): scheduler, runner inputs, sampler,
detokenizer. `python + scheduling (timed kernels)` is measured without the profiler too: every
kernel a decode step calls (the dense layers, the lm head, the native decode calls) is wrapped in
a `perf_counter` pair for a third pass, and the figure is step wall minus the kernels' time: all
the Python, dispatch and allocation of the step, inside the forward and out (the timer pairs,
~0.5 us each, count in it: an upper bound). Both are held against the issue-23 target of < 1 ms.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Self

from torch.profiler import ProfilerActivity, profile

from halfmoon.kernels import fused as kernels_fused
from halfmoon.kernels import torch_backend as kernels_torch
from halfmoon.core.params import SamplingParams
from halfmoon.engine.engine import Engine
from halfmoon.engine.model import DecoderModel

# Op name fragments -> category; the first match wins.
CATEGORIES = (
    ("linear (weights)", ("linear", "mm", "addmm", "matmul", "weight_int")),
    ("attention kernel", ("scaled_dot_product", "flash_attention", "paged_attention")),
    ("KV gather/scatter", ("index_select", "index_copy", "index")),
    ("norms/rope/act", ("rms_norm", "pow", "rsqrt", "mean", "silu", "addcmul", "flip", "mul", "add")),
)
# The issue-23 target for `python + scheduling` and for the per-step overhead (ms per step).
OVERHEAD_TARGET_MS = 1.0


def categorize(op_name: str) -> str:
    for category, fragments in CATEGORIES:
        if any(f in op_name for f in fragments):
            return category
    return "other ops"


def decode_step_profile(engine: Engine, prompt: list[int], steps: int = 16) -> dict[str, float]:
    """ms per batch-1 decode step: ops by category, `python + scheduling` (unprofiled wall minus
    ops), `per-step overhead` (unprofiled wall minus forward), and the walls themselves."""
    engine.add_request(prompt, SamplingParams(max_tokens=3 * steps + 8, ignore_eos=True), request_id="profile")
    try:
        while engine.scheduler.running == [] or engine.scheduler.running[0].num_output_tokens < 4:
            engine.step()  # past prefill and the first decodes
        walls, forwards = _timed_steps(engine, steps)
        glue = _glue_steps(engine, steps)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            profiled_ms = (time.perf_counter() - start) * 1e3 / steps
    finally:
        engine.abort("profile")
        while engine.has_unfinished():
            engine.step()
    per_step: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        per_step[categorize(event.key)] += event.self_cpu_time_total / 1e3 / steps
    wall_ms = statistics.median(walls)
    ops_ms = sum(per_step.values())
    per_step["python + scheduling"] = max(0.0, wall_ms - ops_ms)
    per_step["python + scheduling (profiled)"] = max(0.0, profiled_ms - ops_ms)
    per_step["per-step overhead (outside the forward)"] = statistics.median(
        w - f for w, f in zip(walls, forwards))
    per_step["python + scheduling (timed kernels)"] = glue
    per_step["step (wall)"] = wall_ms
    per_step["step (wall, profiled)"] = profiled_ms
    return {k: round(v, 3) for k, v in per_step.items()}


def _timed_steps(engine: Engine, steps: int) -> tuple[list[float], list[float]]:
    """ms of each step's wall and of its forward pass, without the profiler."""
    walls, forwards = [], []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        walls.append((time.perf_counter() - start) * 1e3)
        forwards.append(engine.runner.last_forward_s * 1e3)
    return walls, forwards


def _glue_steps(engine: Engine, steps: int) -> float:
    """Median ms per step outside the step's kernels, without the profiler (`KernelClock`)."""
    glue = []
    with KernelClock(engine.model) as clock:
        for _ in range(steps):
            clock.total_s = 0.0
            start = time.perf_counter()
            engine.step()
            glue.append((time.perf_counter() - start - clock.total_s) * 1e3)
    return statistics.median(glue)


class KernelClock:
    """While inside: every kernel of `model`'s steps (its dense layers and lm head, the native
    decode calls of kernels/fused.py and kernels/torch_backend.py) adds its wall time to
    `total_s`. Wraps at one level only (a dense layer's own native call is inside the layer's
    time), and puts everything back on exit."""

    def __init__(self, model: DecoderModel) -> None:
        self.model = model
        self.total_s = 0.0
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> Self:
        for lw in self.model.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                self._swap(lw, name, self._timed(getattr(lw, name)))
        self._swap(self.model, "lm_head", self._timed(self.model.lm_head))
        for module, name in ((kernels_fused, "_fused"), (kernels_fused, "_paged_attn"),
                             (kernels_torch, "_paged_attn")):
            if getattr(module, name) is not None:
                self._swap(module, name, _TimedModule(getattr(module, name), self))
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _swap(self, owner: Any, name: str, new: Any) -> None:
        old = getattr(owner, name)
        setattr(owner, name, new)
        self._undo.append(lambda: setattr(owner, name, old))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.total_s += time.perf_counter() - start
        return _TimedLayer(fn, timed)


class _TimedLayer:
    """A dense layer whose calls are timed; its other attributes are the layer's."""

    def __init__(self, layer: Any, call: Callable[..., Any]) -> None:
        self._layer, self._call = layer, call

    def __call__(self, *args: Any) -> Any:
        return self._call(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


class _TimedModule:
    """A native module whose functions are timed by `clock`."""

    def __init__(self, module: Any, clock: KernelClock) -> None:
        self._module, self._clock = module, clock

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._module, name)
        return self._clock._timed(attr) if callable(attr) else attr


def overhead_line(profile_ms: dict[str, float]) -> str:
    """The per-step overhead against the issue-23 target, for the bench's text output."""
    outside = profile_ms["per-step overhead (outside the forward)"]
    glue = profile_ms["python + scheduling (timed kernels)"]
    return (f"per-step overhead outside the forward (scheduler, runner inputs, sampler, detokenizer; "
            f"no profiler): {outside:.2f} ms (target < {OVERHEAD_TARGET_MS:g} ms: {_verdict(outside)}); "
            f"python + scheduling incl. the glue between ops (step wall - timed kernels, no profiler): "
            f"{glue:.2f} ms (target < {OVERHEAD_TARGET_MS:g} ms: {_verdict(glue)}); with the profiler: "
            f"{profile_ms['python + scheduling']:.2f} ms (unprofiled wall - ops) to "
            f"{profile_ms['python + scheduling (profiled)']:.2f} ms (profiled wall - ops); "
            f"step {profile_ms['step (wall)']:.2f} ms")


def _verdict(ms: float) -> str:
    return "met" if ms < OVERHEAD_TARGET_MS else "MISSED"
