"""A trace as the simulator replays it: arrivals in seconds, lengths, and prefix block identities.

A Mooncake trace names a prompt's content only by `hash_ids`, one per 512 tokens: two prompts
share a 512-token block exactly when their hash ids agree up to and including it. Nothing finer
exists in the trace, so the simulator's prefix caches work in blocks of one hash id. A block's
identity is a chained digest of the hash ids up to it (deterministic, 16 bytes like
kvpool/block_hash.py's), computed once per distinct (parent, hash id):

    hash_ids      [    7    |    8    |   21   ]
    block ids     d(root,7)  d(b0, 8)  d(b1, 21)      only whole blocks are cached

`speed` scales time (x2 = arrivals twice as dense), `window_s` keeps the first seconds of the
scaled trace, `max_input_tokens` / `max_output_tokens` cap lengths as `halfmoon bench serve`
does, so a slice replayed live and simulated is the same list of requests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpool.block_hash import HASH_BYTES
from sim.trace import HASH_BLOCK_TOKENS, TraceRequest, read_trace

ROOT = b"halfmoon-sim".ljust(HASH_BYTES, b"\0")


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a simulated replay. `blocks`: identities of its whole 512-token blocks."""

    index: int
    arrival_s: float
    prompt_len: int
    output_len: int
    blocks: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Workload:
    """The requests of one replay, in arrival order, and the span they arrive over."""

    requests: tuple[SimRequest, ...]
    duration_s: float
    source: str = ""


class BlockIds:
    """Chained block identities, cached per (parent, hash id)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[bytes, int], bytes] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def of(self, hash_ids: Sequence[int], whole_blocks: int) -> tuple[bytes, ...]:
        parent, out = ROOT, []
        for hash_id in hash_ids[:whole_blocks]:
            key = (parent, hash_id)
            block = self._ids.get(key)
            if block is None:
                digest = hashlib.blake2b(parent + hash_id.to_bytes(8, "little"), digest_size=HASH_BYTES)
                block = self._ids[key] = digest.digest()
            out.append(block)
            parent = block
        return tuple(out)


def build(trace: Iterable[TraceRequest], speed: float = 1.0, window_s: float | None = None,
          max_input_tokens: int | None = None, max_output_tokens: int | None = None,
          source: str = "") -> Workload:
    """The trace at `speed` (arrival = timestamp / speed, as `halfmoon bench serve --trace`
    sends it), the requests arriving in its first `window_s` seconds (None = all), lengths capped."""
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    ids = BlockIds()
    entries = sorted(trace, key=lambda r: r.timestamp)  # stable: equal timestamps keep file order
    requests: list[SimRequest] = []
    for r in entries:
        arrival = r.timestamp / 1e3 / speed
        if window_s is not None and arrival > window_s:
            break
        prompt = min(r.input_length, max_input_tokens or r.input_length)
        output = max(1, min(r.output_length, max_output_tokens or r.output_length))
        requests.append(SimRequest(len(requests), arrival, prompt, output,
                                   ids.of(r.hash_ids, prompt // HASH_BLOCK_TOKENS)))
    full = entries[-1].timestamp / 1e3 / speed if entries else 0.0
    duration = full if window_s is None or window_s >= full else window_s  # bench's `windowed`
    return Workload(tuple(requests), duration, source)


def load(path: str | Path, speed: float = 1.0, window_s: float | None = None,
         max_input_tokens: int | None = None, max_output_tokens: int | None = None) -> Workload:
    """`build` over a Mooncake trace file (TraceError names a bad line)."""
    return build(read_trace(path), speed, window_s, max_input_tokens, max_output_tokens, str(path))
