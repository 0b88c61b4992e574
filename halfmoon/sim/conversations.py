"""Synthetic conversation traces in the Mooncake format, for benchmarks and the simulator.

Sessions open as a Poisson process, each on one of a few shared system prompts; every turn's
prompt is the conversation so far (its hash ids: system prompt, earlier turns and answers) plus
a new user message, so prefixes are reused the way FAST'25's conversation trace reuses them.
The think time between turns sets how far apart a prefix's reuses are: long think times and
many sessions make a working set larger than one worker's device tier (issue 24's spill case).

    session ──> [sys][t1]             turn 1
                [sys][t1 a1][t2]      turn 2, `think_s` later: reuses turn 1's blocks
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from halfmoon.sim.trace import HASH_BLOCK_TOKENS


@dataclass(frozen=True, slots=True)
class ConversationShape:
    """sessions_per_s: Poisson session starts; turns: a session's turn count is drawn from these
    (repeats weight it); think_s: (lo, hi) seconds between turns, uniform; user_tokens /
    output_tokens: (lo, hi) per turn, uniform; system_prompts: shared prompts of 1-2 blocks."""

    sessions_per_s: float = 2.0
    turns: tuple[int, ...] = (1, 1, 2, 3, 4)
    think_s: tuple[float, float] = (5.0, 30.0)
    user_tokens: tuple[int, int] = (40, 600)
    output_tokens: tuple[int, int] = (16, 160)
    system_prompts: int = 4

    def __post_init__(self) -> None:
        if not self.sessions_per_s > 0:
            raise ValueError(f"sessions_per_s must be > 0, got {self.sessions_per_s}")
        if not self.turns or min(self.turns) < 1:
            raise ValueError(f"turns must be counts >= 1, got {self.turns}")
        for name in ("think_s", "user_tokens", "output_tokens"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"{name} must be (lo, hi) with 0 <= lo <= hi, got {(lo, hi)}")
        if self.user_tokens[0] < 1 or self.system_prompts < 1:
            raise ValueError("user_tokens and system_prompts must be >= 1")


def conversation_trace(n_requests: int, seed: int = 0, shape: ConversationShape = ConversationShape(),
                       adapters: int = 0, adapter_skew: float = 1.0) -> list[dict[str, Any]]:
    """`n_requests` Mooncake rows in timestamp order (module doc), the same for the same seed.
    `adapters` > 0: each session runs under one of that many LoRA adapters (`"adapter":
    "adapter-K"`), K drawn Zipf(`adapter_skew`) from its own generator (the rows are otherwise
    those of `adapters=0`)."""
    if n_requests < 0:
        raise ValueError(f"n_requests must be >= 0, got {n_requests}")
    if adapters < 0 or adapter_skew < 0:
        raise ValueError(f"adapters must be >= 0 and adapter_skew >= 0, got {adapters}, {adapter_skew}")
    pick = random.Random(seed + 1)
    weights = [1.0 / (k + 1) ** adapter_skew for k in range(adapters)]
    rng = random.Random(seed)
    counter = iter(range(1 << 62))
    systems = [[next(counter) for _ in range(rng.choice((1, 2)))] for _ in range(shape.system_prompts)]
    rows: list[dict[str, Any]] = []
    t = 0.0
    while len(rows) < n_requests:
        t += rng.expovariate(shape.sessions_per_s)
        ids, at = list(rng.choice(systems)), t
        length = len(ids) * HASH_BLOCK_TOKENS
        extra = {"adapter": f"adapter-{pick.choices(range(adapters), weights)[0]}"} if adapters else {}
        for _ in range(rng.choice(shape.turns)):
            total = length + rng.randint(*shape.user_tokens)
            ids = ids[: length // HASH_BLOCK_TOKENS]
            ids += [next(counter) for _ in range(-(-total // HASH_BLOCK_TOKENS) - len(ids))]
            output = rng.randint(*shape.output_tokens)
            rows.append({"timestamp": int(at * 1000), "input_length": total, "output_length": output,
                         "hash_ids": list(ids), **extra})
            length = total + output
            at += rng.uniform(*shape.think_s)
    rows.sort(key=lambda r: r["timestamp"])
    return rows[:n_requests]


def trace_text(rows: Sequence[dict[str, Any]]) -> str:
    """One JSON object per line (the format `sim.trace.read_trace` reads)."""
    return "".join(json.dumps(r) + "\n" for r in rows)


def write_trace(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """`trace_text` into a file."""
    path = Path(path)
    path.write_text(trace_text(rows))
    return path
