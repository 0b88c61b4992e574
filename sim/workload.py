"""A trace as the simulator replays it: arrivals in seconds, lengths, and prefix block identities.

A Mooncake trace names a prompt's content only by `hash_ids`, one per 512 tokens: two prompts
share a 512-token block exactly when their hash ids agree up to and including it. Nothing finer
exists in the trace, so the simulator's prefix caches work in blocks of one hash id. A block's
identity is a chained digest of the hash ids up to it (deterministic, 16 bytes like
kvpool/block_hash.py's), computed once per distinct (parent, hash id):

    hash_ids      [    7    |    8    |  21 ]         input_length 1300
    block ids     d(root,7)  d(b0, 8)  d(b1, 21, 276)

A partial last block's identity also names its length: two prompts whose last blocks carry the
same hash id after the same chain and end at the same token hold the same tokens there (the live
replay builds them so: bench/trace.py), so the engine, which caches 16-token blocks, reuses it.

`speed` scales time (x2 = arrivals twice as dense), `window_s` keeps the first seconds of the
scaled trace, `max_input_tokens` / `max_output_tokens` cap lengths as `halfmoon bench serve`
does, so a slice replayed live and simulated is the same list of requests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from core.blocks import cdiv
from kvpool.block_hash import HASH_BYTES
from sim.trace import HASH_BLOCK_TOKENS, TraceRequest, read_trace

ROOT = b"halfmoon-sim".ljust(HASH_BYTES, b"\0")


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a simulated replay. `blocks`: identities of its 512-token blocks, the
    partial last one included (module docstring)."""

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
        self._ids: dict[tuple[bytes, int, int], bytes] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def of(self, hash_ids: Sequence[int], prompt_len: int) -> tuple[bytes, ...]:
        """The ids of a `prompt_len`-token prompt's blocks (a partial last one names its length)."""
        parent, out = ROOT, []
        for i, hash_id in enumerate(hash_ids[:cdiv(prompt_len, HASH_BLOCK_TOKENS)]):
            fill = min(HASH_BLOCK_TOKENS, prompt_len - i * HASH_BLOCK_TOKENS)
            parent = self._id(parent, hash_id, 0 if fill == HASH_BLOCK_TOKENS else fill)
            out.append(parent)
        return tuple(out)

    def _id(self, parent: bytes, hash_id: int, partial: int) -> bytes:
        key = (parent, hash_id, partial)
        block = self._ids.get(key)
        if block is None:
            data = parent + hash_id.to_bytes(8, "little") + (partial.to_bytes(2, "little") if partial else b"")
            block = self._ids[key] = hashlib.blake2b(data, digest_size=HASH_BYTES).digest()
        return block


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
                                   ids.of(r.hash_ids, prompt)))
    full = entries[-1].timestamp / 1e3 / speed if entries else 0.0
    duration = full if window_s is None or window_s >= full else window_s  # bench's `windowed`
    return Workload(tuple(requests), duration, source)


def load(path: str | Path, speed: float = 1.0, window_s: float | None = None,
         max_input_tokens: int | None = None, max_output_tokens: int | None = None) -> Workload:
    """`build` over a Mooncake trace file (TraceError names a bad line)."""
    return build(read_trace(path), speed, window_s, max_input_tokens, max_output_tokens, str(path))
