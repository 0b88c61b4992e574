"""The reference's conversion cache (bench/hf_reference.py), with a stand-in for a transformers
object (it has `save_pretrained`, as theirs do): converted once, loaded after, a broken entry
converted again. The real model and tokenizer go through it in tests/engine."""

from __future__ import annotations

import json
from pathlib import Path

from halfmoon.bench.hf_reference import _cached


class FakePretrained:
    """Named as what it is: a stand-in writing a config.json like transformers' objects do."""

    def __init__(self, value: int) -> None:
        self.value = value

    def save_pretrained(self, folder: str) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "config.json").write_text(json.dumps({"value": self.value}))


def load(folder: Path) -> FakePretrained:
    return FakePretrained(json.loads((folder / "config.json").read_text())["value"])


def test_converted_once_then_loaded(tmp_path: Path) -> None:
    calls: list[int] = []

    def convert() -> FakePretrained:
        calls.append(1)
        return FakePretrained(7)

    entry = tmp_path / "hf" / "key"
    assert _cached(entry, convert, load).value == 7
    assert _cached(entry, convert, load).value == 7
    assert len(calls) == 1 and not entry.with_name("key.tmp").exists()


def test_a_broken_entry_is_converted_again(tmp_path: Path) -> None:
    entry = tmp_path / "hf" / "key"
    _cached(entry, lambda: FakePretrained(1), load)
    (entry / "config.json").write_text("{not json")
    assert _cached(entry, lambda: FakePretrained(2), load).value == 2
    assert load(entry).value == 2
