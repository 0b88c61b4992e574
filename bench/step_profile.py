"""Where one decode step's time goes: torch profiler over real engine steps, ops grouped.

Used by `halfmoon bench engine` to back the roofline line with a breakdown.
"""

from __future__ import annotations

import time
from collections import defaultdict

from torch.profiler import ProfilerActivity, profile

from engine.engine import Engine
from core.params import SamplingParams

# Op name fragments -> category; the first match wins.
CATEGORIES = (
    ("linear (weights)", ("linear", "mm", "addmm", "matmul")),
    ("attention kernel", ("scaled_dot_product", "flash_attention")),
    ("KV gather/scatter", ("index_select", "index_copy", "index")),
    ("norms/rope/act", ("rms_norm", "pow", "rsqrt", "mean", "silu", "addcmul", "flip", "mul", "add")),
)


def categorize(op_name: str) -> str:
    for category, fragments in CATEGORIES:
        if any(f in op_name for f in fragments):
            return category
    return "other ops"


def decode_step_profile(engine: Engine, prompt: list[int], steps: int = 16) -> dict[str, float]:
    """ms per decode step by category (plus `python + scheduling`: wall time no op accounts for)."""
    engine.add_request(prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True), request_id="profile")
    while engine.scheduler.running == [] or engine.scheduler.running[0].num_output_tokens < 4:
        engine.step()  # past prefill and the first decodes
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    per_step: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        per_step[categorize(event.key)] += event.self_cpu_time_total / 1e3 / steps
    engine.abort("profile")
    while engine.has_unfinished():
        engine.step()
    per_step["python + scheduling"] = max(0.0, wall_ms - sum(per_step.values()))
    per_step["step (wall, profiled)"] = wall_ms
    return {k: round(v, 3) for k, v in per_step.items()}
