"""What the simulator tests share: the bundled Mooncake-format sample trace."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "halfmoon" / "bench" / "data" / "sample_trace.jsonl"  # bench/data/README.md: what it is, how it was made


def sample_trace() -> Path:
    """The bundled sample trace (part of the repository: a missing one is a failure, not a skip)."""
    if not SAMPLE.is_file():
        raise FileNotFoundError(f"the bundled sample trace {SAMPLE} is missing")
    return SAMPLE
