"""Random instances of the offline optimum (sim/optimum.py) shared by its tests."""

from __future__ import annotations

import math
import random

from halfmoon.conductor.cost_model import CostModel
from halfmoon.sim.optimum import Job, Reference

# prefill(n) = 35 + 2n + 0.001 n^2 ms; decode step = 45 + 0.4 b + 0.009 k ms (a CPU's shape)
CPU = CostModel((35.0, 2.0, 0.0, 0.001), (45.0, 0.4, 0.009), 2e9, 1000, "test: CPU-like")
FLAT = CostModel((0.0, 1.0, 0.0, 0.0), (10.0, 0.0, 0.0), 1e9, 1000, "test: flat")


def random_jobs(rng: random.Random, n: int, bursty: bool) -> list[Job]:
    """Requests arriving apart, or in bursts (a few arriving within 20 ms of each other)."""
    t, jobs = 0.0, []
    for _ in range(n):
        t += rng.uniform(0, 20) if bursty and rng.random() < 0.75 else rng.uniform(0, 800)
        prompt, output = rng.randint(50, 700), rng.randint(1, 60)
        jobs.append(Job(t, prompt, output, CPU.est_prefill_ms(prompt), rng.uniform(0, 30),
                        kv_blocks=-(-(prompt + output) // 16)))
    return jobs


def random_reference(rng: random.Random, shape: tuple[int, int]) -> Reference:
    return Reference(*shape, rng.choice([1000.0, 2000.0]), rng.choice([55.0, 60.0, 80.0]), CPU,
                     rng.choice([math.inf, 90.0]))


def plan_of(optimum_schedule: tuple, n: int, warmed: tuple = ()) -> list[tuple[int, int] | None]:
    placed = {p.job: (p.prefill, p.decode) for p in (*optimum_schedule, *warmed)}
    return [placed.get(i) for i in range(n)]
