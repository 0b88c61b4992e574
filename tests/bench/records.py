"""Hand-made inputs of the serve benchmarks' tests: request timelines, records, trace files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from halfmoon.bench import serve_metrics as sm


def timeline(gaps: list[float], first: float = 0.5) -> list[float]:
    """Token times: the first at `first`, then one after each gap."""
    return list(np.cumsum([first, *gaps]))


def record(ttft: float, gaps: list[float], status: str = "ok", code: str | None = None,
           prompt: int = 100, cached: int = 0) -> sm.RequestRecord:
    """A request arriving at 1 s; tokens (for an "ok" one) from 1 s + `ttft` on, `gaps` apart."""
    times = timeline(gaps, 1.0 + ttft) if status == "ok" else []
    return sm.RequestRecord(0, 1.0, prompt, len(times), sent_s=1.0, token_times=times, done_s=9.0,
                            cached_tokens=cached, status=status, code=code)


def write_trace(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    """A Mooncake trace of (timestamp ms, input length, output length, hash ids) rows."""
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h})
                            + "\n" for t, n, o, h in rows))
    return path
