"""Synthetic bursty traces in the Mooncake format: bursts of requests arriving together, idle
gaps between them (issue 38's case: bursts of 10-16 requests against 1P1D, where FCFS prefill
of a burst decides who can meet TTFT).

    burst 1: n1 requests at t1         (n drawn from `size`, all at the burst's timestamp)
    burst 2: n2 requests at t1 + gap   (gap drawn from `gap_s`, uniform)

Each prompt is its own (fresh hash ids: no prefix is shared), so every prefill costs what its
length does; lengths are uniform in `input_tokens` / `output_tokens`. Deterministic per seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from halfmoon.sim.trace import HASH_BLOCK_TOKENS


@dataclass(frozen=True, slots=True)
class BurstShape:
    """size: (lo, hi) requests per burst; gap_s: (lo, hi) seconds between bursts;
    input_tokens / output_tokens: (lo, hi) per request, uniform."""

    size: tuple[int, int] = (10, 16)
    gap_s: tuple[float, float] = (10.0, 20.0)
    input_tokens: tuple[int, int] = (64, 512)
    output_tokens: tuple[int, int] = (16, 128)

    def __post_init__(self) -> None:
        for name in ("size", "gap_s", "input_tokens", "output_tokens"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"{name} must be (lo, hi) with 0 <= lo <= hi, got {(lo, hi)}")
        if self.size[0] < 1 or self.input_tokens[0] < 1 or self.output_tokens[0] < 1:
            raise ValueError("size, input_tokens and output_tokens must be >= 1")


def bursty_trace(n_requests: int, seed: int = 0, shape: BurstShape = BurstShape()) -> list[dict[str, Any]]:
    """`n_requests` Mooncake rows in timestamp order (module docstring), the same for the same seed."""
    if n_requests < 0:
        raise ValueError(f"n_requests must be >= 0, got {n_requests}")
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    t, next_id = 0.0, 0
    while len(rows) < n_requests:
        for _ in range(min(rng.randint(*shape.size), n_requests - len(rows))):
            prompt = rng.randint(*shape.input_tokens)
            blocks = -(-prompt // HASH_BLOCK_TOKENS)
            rows.append({"timestamp": int(t * 1000), "input_length": prompt,
                         "output_length": rng.randint(*shape.output_tokens),
                         "hash_ids": list(range(next_id, next_id + blocks))})
            next_id += blocks
        t += rng.uniform(*shape.gap_s)
    return rows
