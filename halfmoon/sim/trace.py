"""Mooncake-format request traces: one JSON object per line (blank lines are skipped, extra keys
ignored):

    {"timestamp": 150, "input_length": 1123, "output_length": 145, "hash_ids": [0, 1, 6]}

`timestamp` is in ms; `hash_ids` names the prompt's 512-token blocks, so there are exactly
ceil(input_length / 512) of them, and two requests whose hash_ids agree on a prefix share that
prefix of tokens. Halfmoon's own optional key `"adapter": "NAME"` names the LoRA adapter a
request runs under (absent or null: the base model); prefixes are never shared across adapters. A bad line raises `TraceError` naming the file and line number. The simulator
reads traces here; `bench/trace.py` adds the token synthesizer the live benchmarks send.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from halfmoon.core.blocks import cdiv

HASH_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces
REQUIRED_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace line that is not a valid Mooncake request (the message names file and line)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. `line` is its 1-based line number in the file."""

    line: int
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    adapter: str = ""  # the LoRA adapter it names ("" = the base model)


def read_trace(path: str | Path) -> Iterator[TraceRequest]:
    """Yield the requests of a Mooncake trace in file order; raises TraceError on a bad line
    and FileNotFoundError when the file is missing."""
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if text.strip():
                yield parse_line(text, number, str(path))


def parse_line(text: str, line: int, source: str = "<trace>") -> TraceRequest:
    """Validate one JSON line into a TraceRequest."""
    where = f"{source}:{line}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise TraceError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in obj]
    if missing:
        raise TraceError(f"{where}: missing key(s) {', '.join(missing)}")
    timestamp = obj["timestamp"]
    if not _is_number(timestamp) or timestamp < 0:
        raise TraceError(f"{where}: timestamp must be a number of ms >= 0, got {timestamp!r}")
    input_length = _int_field(obj, "input_length", 1, where)
    output_length = _int_field(obj, "output_length", 0, where)
    hash_ids = _hash_ids(obj["hash_ids"], input_length, where)
    adapter = obj.get("adapter") or ""
    if not isinstance(adapter, str):
        raise TraceError(f"{where}: adapter must be a string (a LoRA adapter's name) or null, got {adapter!r}")
    return TraceRequest(line, float(timestamp), input_length, output_length, hash_ids, adapter)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int_field(obj: dict[str, Any], key: str, minimum: int, where: str) -> int:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def _hash_ids(value: Any, input_length: int, where: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise TraceError(f"{where}: hash_ids must be a list of integers, got {value!r}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise TraceError(f"{where}: hash_ids must be integers >= 0, got {item!r}")
    expected = cdiv(input_length, HASH_BLOCK_TOKENS)
    if len(value) != expected:
        raise TraceError(f"{where}: input_length {input_length} needs {expected} hash ids "
                         f"(one per {HASH_BLOCK_TOKENS} tokens), got {len(value)}")
    return tuple(value)
