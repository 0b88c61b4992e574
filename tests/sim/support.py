"""What the simulator tests share: a Mooncake-format sample trace."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT.parent / "shared" / "data" / "sample_trace.jsonl"
BUNDLED = ROOT / "bench" / "data"


def sample_trace() -> Path:
    if SAMPLE.exists():
        return SAMPLE
    bundled = sorted(BUNDLED.glob("*.jsonl"))
    if not bundled:
        pytest.skip("no Mooncake-format sample trace here (../shared/data or bench/data)")
    return bundled[0]
