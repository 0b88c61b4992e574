"""The profile cache (conductor/profile_cache.py): its key covers every engine field a
measurement depends on (a profile of one-prompt-a-step prefills is never read for another
packing: issue 45), the grid and the format; an unreadable entry, or one that predicts times no
engine has, is measured again; a good one is read back without measuring."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from halfmoon.conductor import profile_cache
from halfmoon.conductor.cost_model import CostModel
from halfmoon.core.cache_dir import CACHE_ENV
from halfmoon.core.messages import EngineInfo
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.profiling import FULL_GRID, QUICK_GRID

INFO = EngineInfo(8192, 49152, "fp-test", 16, "float32", 92160)
GOOD = CostModel((5.0, 1.8, 0.0, 0.0002), (40.0, 4.0, 0.002), 1e9, 92160, "test")
IMPOSSIBLE = CostModel((0.0, 0.0, 0.0, 0.0), (0.0, 0.0, 0.0), 1e9, 92160, "test: all zero")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    return tmp_path / "profiles"


def test_the_key_covers_the_engine_shape_the_grid_and_the_format(monkeypatch: pytest.MonkeyPatch) -> None:
    base = EngineConfig(num_threads=1)
    key = profile_cache.profile_key(INFO, base)
    assert key == profile_cache.profile_key(INFO, dataclasses.replace(base))  # deterministic
    for change in ({"max_prefill_seqs": 1}, {"max_num_batched_tokens": 256}, {"speculative": "ngram"},
                   {"tp": 2}, {"block_size": 32}, {"num_threads": 2}, {"quantization": "int8"}):
        assert profile_cache.profile_key(INFO, dataclasses.replace(base, **change)) != key, change
    assert profile_cache.profile_key(INFO, base, FULL_GRID) != profile_cache.profile_key(INFO, base, QUICK_GRID)
    assert profile_cache.profile_key(dataclasses.replace(INFO, dtype="bfloat16"), base) != key
    monkeypatch.setattr(profile_cache, "PROFILE_FORMAT", profile_cache.PROFILE_FORMAT + 1)
    assert profile_cache.profile_key(INFO, base) != key  # an older format's entries are never read


def _cached(key: str) -> tuple[CostModel, int]:
    calls = []

    async def measure() -> CostModel:
        calls.append(1)
        return GOOD

    return asyncio.run(profile_cache.cached_cost_model(key, measure)), len(calls)


def test_measured_once_then_read_back(cache: Path) -> None:
    assert _cached("k1") == (GOOD, 1)
    assert (cache / "k1.json").is_file() and not list(cache.glob("*.tmp*"))
    assert _cached("k1") == (GOOD, 0)


@pytest.mark.parametrize("content", ["{not json", '{"version": 1}', IMPOSSIBLE.to_json()])
def test_an_unreadable_or_impossible_entry_is_measured_again(cache: Path, content: str) -> None:
    cache.mkdir(parents=True)
    (cache / "k2.json").write_text(content)
    assert _cached("k2") == (GOOD, 1)
    assert CostModel.load(cache / "k2.json") == GOOD  # replaced by the new measurement
