"""A trace as the simulator replays it: arrivals in seconds, lengths, and prefix block identities.

A Mooncake trace names a prompt's content only by `hash_ids`, one per 512 tokens: two prompts
share a 512-token block exactly when their hash ids agree up to and including it. Nothing finer
exists in the trace, so the simulator's prefix caches work in blocks of one hash id. A block's
identity is a chained digest of the hash ids up to it (deterministic, 16 bytes like
kvpool/block_hash.py's), computed once per distinct (parent, hash id):

    hash_ids      [    7    |    8    |  21 ]         input_length 1300
    block ids     d(root,7)  d(b0, 8)  d(b1, 21)       (the last: 276 tokens of id 21)

A LoRA adapter roots its own chain (as live, kvpool/block_hash.py): the same hash ids under two
adapters, or an adapter and the base model, are different blocks.

A partial last block has the identity of its hash id's chain whatever its length: the live
replay's tokens of a hash id are the same at every length (bench/trace.py), so a prompt that
ends inside a block shares that block's first tokens with every prompt carrying the same chain.
How many of a block's tokens a cache holds is the cache's to track (sim/tiers.py, `fill`).

`speed` scales time (x2 = arrivals twice as dense), `window_s` keeps the first seconds of the
scaled trace, `max_input_tokens` / `max_output_tokens` cap lengths as `halfmoon bench serve`
does, so a slice replayed live and simulated is the same list of requests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from halfmoon.core.blocks import cdiv
from halfmoon.kvpool.block_hash import HASH_BYTES
from halfmoon.sim.trace import HASH_BLOCK_TOKENS, TraceRequest, read_trace

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
    adapter: str = ""  # the LoRA adapter it runs under ("" = the base model)


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

    def of(self, hash_ids: Sequence[int], prompt_len: int, adapter: str = "") -> tuple[bytes, ...]:
        """The ids of a `prompt_len`-token prompt's blocks (a partial last one included), under
        `adapter`'s root ("" = the base model's)."""
        parent, out = _root(adapter), []
        for hash_id in hash_ids[:cdiv(prompt_len, HASH_BLOCK_TOKENS)]:
            parent = self._id(parent, hash_id)
            out.append(parent)
        return tuple(out)

    def _id(self, parent: bytes, hash_id: int) -> bytes:
        key = (parent, hash_id)
        block = self._ids.get(key)
        if block is None:
            data = parent + hash_id.to_bytes(8, "little")
            block = self._ids[key] = hashlib.blake2b(data, digest_size=HASH_BYTES).digest()
        return block


def _root(adapter: str) -> bytes:
    return ROOT if not adapter else hashlib.blake2b(ROOT + adapter.encode(), digest_size=HASH_BYTES).digest()


def build(trace: Iterable[TraceRequest], speed: float = 1.0, window_s: float | None = None,
          max_input_tokens: int | None = None, max_output_tokens: int | None = None,
          source: str = "", max_requests: int | None = None) -> Workload:
    """The trace at `speed` (arrival = timestamp / speed, as `halfmoon bench serve --trace`
    sends it), the requests arriving in its first `window_s` seconds (None = all), lengths capped;
    `max_requests`: its first N requests only, as bench serve's --max-requests (the window is then
    their span)."""
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    ids = BlockIds()
    # the first N in file order, as bench serve takes them; sorted stably (equal timestamps keep file order)
    entries = sorted(list(trace)[:max_requests], key=lambda r: r.timestamp)
    requests: list[SimRequest] = []
    for r in entries:
        arrival = r.timestamp / 1e3 / speed
        if window_s is not None and arrival > window_s:
            break
        prompt = min(r.input_length, max_input_tokens or r.input_length)
        output = max(1, min(r.output_length, max_output_tokens or r.output_length))
        requests.append(SimRequest(len(requests), arrival, prompt, output,
                                   ids.of(r.hash_ids, prompt, r.adapter), r.adapter))
    full = entries[-1].timestamp / 1e3 / speed if entries else 0.0
    duration = full if window_s is None or window_s >= full else window_s  # bench's `windowed`
    return Workload(tuple(requests), duration, source)


def load(path: str | Path, speed: float = 1.0, window_s: float | None = None,
         max_input_tokens: int | None = None, max_output_tokens: int | None = None,
         max_requests: int | None = None) -> Workload:
    """`build` over a Mooncake trace file (TraceError names a bad line)."""
    return build(read_trace(path), speed, window_s, max_input_tokens, max_output_tokens, str(path), max_requests)
