"""The dequantized-weights cache: stored on the first load, memory-mapped on the next ones,
rebuilt (loudly) when an entry is unreadable, keyed by the source file and dtype, pruned to
`MAX_ENTRIES`, and off with HALFMOON_WEIGHTS_CACHE=0."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from halfmoon.core.cache_dir import CACHE_ENV
from halfmoon.engine import weights_cache
from halfmoon.engine.loader import LoadedWeights, load_weights
from halfmoon.engine.weights_cache import cached_weights, entry_path


@pytest.fixture(autouse=True)
def cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(weights_cache.ENABLE_ENV, raising=False)
    return tmp_path / "cache"


def source(tmp_path: Path, name: str = "model.gguf", data: bytes = b"GGUF v3") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


class Builder:
    """A stand-in for dequantization that counts its calls (the tensors are real)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> dict[str, torch.Tensor]:
        self.calls += 1
        return {"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b.weight": torch.ones(5)}


def test_the_first_load_stores_and_the_next_one_maps_the_same_tensors(tmp_path: Path) -> None:
    src, build = source(tmp_path), Builder()
    first = cached_weights(src, torch.float32, build)
    assert entry_path(src, torch.float32).is_file()
    second = cached_weights(src, torch.float32, build)
    assert build.calls == 1
    assert second.keys() == first.keys() and all(torch.equal(second[k], first[k]) for k in first)
    second["a.weight"][0, 0] = 99.0  # copy-on-write: the entry is not changed for the next process
    assert cached_weights(src, torch.float32, build)["a.weight"][0, 0] == 0.0


def test_the_key_follows_the_file_and_the_dtype(tmp_path: Path) -> None:
    src = source(tmp_path)
    fp32, bf16 = entry_path(src, torch.float32), entry_path(src, torch.bfloat16)
    assert fp32 != bf16 and fp32 == entry_path(src, torch.float32)  # deterministic
    src.write_bytes(b"GGUF v3, rewritten")  # another size (and mtime): another entry
    assert entry_path(src, torch.float32) != fp32


def test_an_unreadable_entry_is_rebuilt_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src, build = source(tmp_path), Builder()
    cached_weights(src, torch.float32, build)
    entry = entry_path(src, torch.float32)
    entry.write_bytes(entry.read_bytes()[:100])  # truncated
    with caplog.at_level(logging.WARNING, logger=weights_cache.__name__):
        again = cached_weights(src, torch.float32, build)
    assert build.calls == 2 and torch.equal(again["b.weight"], torch.ones(5))
    assert "unreadable entry" in caplog.text
    assert torch.load(entry, weights_only=True).keys() == again.keys()  # stored whole again


def test_an_unwritable_cache_still_serves_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker))
    src, build = source(tmp_path), Builder()
    with caplog.at_level(logging.WARNING, logger=weights_cache.__name__):
        assert torch.equal(cached_weights(src, torch.float32, build)["b.weight"], torch.ones(5))
    assert "could not store" in caplog.text


def test_off_by_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(weights_cache.ENABLE_ENV, "0")
    src, build = source(tmp_path), Builder()
    cached_weights(src, torch.float32, build)
    cached_weights(src, torch.float32, build)
    assert build.calls == 2 and not entry_path(src, torch.float32).exists()


def test_only_the_most_recently_used_entries_are_kept(tmp_path: Path) -> None:
    sources = [source(tmp_path, f"m{i}.gguf", b"x" * (i + 1)) for i in range(weights_cache.MAX_ENTRIES)]
    for i, src in enumerate(sources):
        cached_weights(src, torch.float32, Builder())
        os.utime(entry_path(src, torch.float32), (1000.0 + i, 1000.0 + i))  # distinct last uses
    os.utime(entry_path(sources[0], torch.float32), (5000.0, 5000.0))  # the oldest, used again
    cached_weights(source(tmp_path, "new.gguf", b"new"), torch.float32, Builder())
    kept = {p.name for p in entry_path(sources[0], torch.float32).parent.glob("*.pt")}
    assert len(kept) == weights_cache.MAX_ENTRIES
    assert entry_path(sources[0], torch.float32).name in kept
    assert entry_path(sources[1], torch.float32).name not in kept  # least recently used


@pytest.mark.slow
def test_the_real_model_loads_from_the_cache_as_dequantized(smollm2_weights: LoadedWeights) -> None:
    """SmolLM2 through `load_weights` with an entry in place (stored from the session's own
    dequantized weights, so no second dequantization here): the same tensors, memory-mapped."""
    weights_cache._write(entry_path(smollm2_weights.path, torch.float32), smollm2_weights.weights)
    loaded = load_weights(str(smollm2_weights.path), torch.float32)
    assert loaded.config == smollm2_weights.config
    assert loaded.weights.keys() == smollm2_weights.weights.keys()
    for name, tensor in smollm2_weights.weights.items():
        assert torch.equal(loaded.weights[name], tensor), name


def test_names_the_caller_will_not_read_are_not_prefaulted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, build = source(tmp_path), Builder()
    cached_weights(src, torch.float32, build)
    prefaulted: list[str] = []
    monkeypatch.setattr(weights_cache, "_prefault", lambda w: prefaulted.extend(w))
    loaded = cached_weights(src, torch.float32, build, lazy=frozenset({"a.weight"}))
    assert prefaulted == ["b.weight"]
    assert torch.equal(loaded["a.weight"], build()["a.weight"])  # still there, paged in when read


@pytest.mark.slow
def test_an_int4_load_leaves_the_q4_1_tensors_unread(smollm2_weights: LoadedWeights,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The int4 layers use the file's own blocks: their dequantized copies stay on disk."""
    weights_cache._write(entry_path(smollm2_weights.path, torch.float32), smollm2_weights.weights)
    prefaulted: list[str] = []
    monkeypatch.setattr(weights_cache, "_prefault", lambda w: prefaulted.extend(w))
    loaded = load_weights(str(smollm2_weights.path), torch.float32, q4_blocks=True)
    assert set(prefaulted) == loaded.weights.keys() - loaded.q4.keys()
    assert "model.embed_tokens.weight" in prefaulted and len(loaded.q4) == 7 * loaded.config.num_layers
