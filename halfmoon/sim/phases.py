"""Synthetic traces whose mix shifts: a "day" of phases, each with its own arrival rate and prompt
and output lengths, in the Mooncake format (issue 49: the planner re-balances the pools when the
mix shifts).

    phase 1: Poisson arrivals at rate_1 for duration_1 s, lengths uniform in its ranges
    phase 2: from where phase 1 ended, at rate_2 for duration_2 s, its own ranges
    ...

A spec is `NAME:SECONDS[:RATE]` per phase, comma-separated (`prefill:600,decode:600,prefill:600`):
NAME is a preset (PRESETS: its lengths and its default rate, requests/s for 8 Llama 3 8B H100
workers, the load under which the split matters) and `scale` multiplies every rate (8 for 64
workers); or a JSON list of `{"name", "duration_s", "rate", "input_tokens": [lo, hi],
"output_tokens": [lo, hi]}`. Every prompt is its own (fresh hash ids: no prefix is shared), so
each prefill costs what its length does. Deterministic per seed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from typing import Any

from halfmoon.sim.trace import HASH_BLOCK_TOKENS


@dataclass(frozen=True, slots=True)
class Phase:
    """name: a label (the plot's); duration_s: how long it lasts; rate: Poisson arrivals per
    second; input_tokens / output_tokens: (lo, hi) per request, uniform."""

    name: str
    duration_s: float
    rate: float
    input_tokens: tuple[int, int]
    output_tokens: tuple[int, int]

    def __post_init__(self) -> None:
        if not self.duration_s > 0 or not self.rate > 0:
            raise ValueError(f"phase {self.name!r}: duration_s and rate must be > 0")
        for name in ("input_tokens", "output_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"phase {self.name!r}: {name} must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")


# Lengths of the test mixes of tests/conductor/test_planner.py (long documents with short
# answers; chat with long answers) and a middle one; rates for 8 H100 workers (module docstring).
PRESETS = {
    "prefill": Phase("prefill", 1.0, 20.0, (6000, 8000), (10, 30)),
    "decode": Phase("decode", 1.0, 60.0, (100, 300), (300, 600)),
    "mixed": Phase("mixed", 1.0, 30.0, (1000, 3000), (100, 300)),
}


def parse_phases(spec: str, scale: float = 1.0) -> list[Phase]:
    """The phases of `spec` (module docstring: presets or a JSON list), rates times `scale`;
    ValueError says what is wrong."""
    if not scale > 0:
        raise ValueError(f"the rate scale must be > 0, got {scale}")
    text = spec.strip()
    phases = _json_phases(text) if text.startswith("[") else [_preset(item) for item in text.split(",") if item.strip()]
    if not phases:
        raise ValueError(f"no phases in {spec!r}")
    return [replace(p, rate=p.rate * scale) for p in phases]


def _preset(item: str) -> Phase:
    parts = item.strip().split(":")
    if len(parts) not in (2, 3) or parts[0] not in PRESETS:
        raise ValueError(f"a phase is NAME:SECONDS[:RATE] with NAME one of {sorted(PRESETS)}, got {item!r}")
    base = PRESETS[parts[0]]
    return replace(base, duration_s=float(parts[1]), rate=float(parts[2]) if len(parts) == 3 else base.rate)


def _json_phases(text: str) -> list[Phase]:
    try:
        items = json.loads(text)
        return [Phase(str(i["name"]), float(i["duration_s"]), float(i["rate"]), tuple(i["input_tokens"]),
                      tuple(i["output_tokens"])) for i in items]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"a JSON phase list is [{{name, duration_s, rate, input_tokens, output_tokens}}, ...]: {e}") from None


def boundaries(phases: list[Phase]) -> list[tuple[str, float, float]]:
    """Each phase's (name, start s, end s)."""
    out, t = [], 0.0
    for p in phases:
        out.append((p.name, t, t + p.duration_s))
        t += p.duration_s
    return out


def phased_trace(phases: list[Phase], seed: int = 0) -> list[dict[str, Any]]:
    """Mooncake rows in timestamp order (module docstring), the same for the same seed."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    next_id = 0
    for phase, (_, start, end) in zip(phases, boundaries(phases), strict=True):
        t = start
        while (t := t + rng.expovariate(phase.rate)) < end:
            prompt = rng.randint(*phase.input_tokens)
            blocks = -(-prompt // HASH_BLOCK_TOKENS)
            rows.append({"timestamp": int(t * 1000), "input_length": prompt,
                         "output_length": rng.randint(*phase.output_tokens),
                         "hash_ids": list(range(next_id, next_id + blocks))})
            next_id += blocks
    return rows
