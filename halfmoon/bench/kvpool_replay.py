"""The hit-rate replay of `halfmoon bench kvpool` (its figure 3).

Prompts are synthesized from `hash_ids` (bench.trace) and hashed into chained 16-token block
hashes with kvpool.block_hash. Equal hash-id prefixes give equal block-hash prefixes, so the
hashes of a 512-token block are computed once per (parent hash, hash id) and cached
(`PrefixHasher`, ~0.6 KB per distinct 512-token block); the same cache carries the upper bound.

    device  kvpool.block_pool.BlockPool (the real one: prefix cache, refcounts, lazy LRU
            eviction, tail-first free); its on_evict demotes to
    host    HashLRU, capacity host_blocks; its evictions demote to
    disk    HashLRU, capacity disk_blocks; its evictions are dropped.

`HashLRU` (sim/tiers.py) is a bookkeeping-only LRU of block hashes with the semantics of HostArena and DiskTier
(put of a held hash touches it, reads touch what they read, pinned entries are never evicted).
The real tiers were measured with 8-byte slots (their minimum): ~21 us (host) + ~17 us (disk)
per demoted block, i.e. minutes per capacity for a 100M-token trace; HashLRU takes well under
1 us. Each request, in trace order, follows engine/scheduler.py's admission:

    | device hit (get_computed_blocks) | host/disk hit (promoted) | computed | partial |
    '---------------- usable = (input_length - 1) // 16 blocks ---'

at most (input_length - 1) // 16 blocks can hit (the last token is always recomputed), host
and disk hits are pinned while the device allocation for the rest demotes other blocks, every
full block is registered (cache_blocks), and the request's block table is freed. With
`--running 0` (default) requests run one at a time. With `--running N` up to N requests hold
their blocks at once: each until `timestamp + output_length * tpot_ms`, and the one finishing
first is released early when the pool or the N slots are full (as if the newcomer waited).
A device capacity smaller than the longest prompt cannot hold one request: it is skipped (and
listed as such in the output).

The upper bound is a request's longest run of leading 16-token blocks seen in any earlier
request, capped like the replay; `upper_bound_512` is bench/data/README.md's figure (leading
hash ids seen before, in tokens, uncapped), for reference.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from halfmoon.bench.report import Progress
from halfmoon.bench.trace import DEFAULT_VOCAB_SIZE, HASH_BLOCK_TOKENS, TraceRequest, block_tokens
from halfmoon.core.blocks import cdiv
from halfmoon.kvpool.block_hash import HASH_BYTES, block_hashes, root_hash
from halfmoon.kvpool.errors import PoolIntegrityError
from halfmoon.sim.tiers import Capacity, Hits, TieredCache

BLOCK_SIZE = 16


class BenchInputError(ValueError):
    """The benchmark cannot run on what it was given (missing trace, capacities too small)."""


# ---------------------------------------------------------------- block hashes of a trace


@dataclass(slots=True)
class _Chunk:
    """The 16-token block hashes of one 512-token hash-id block at one position."""

    blob: bytes  # 512 / block_size hashes of HASH_BYTES, concatenated
    last: bytes  # the last of them: the parent of the next chunk
    seen: int = 0  # leading blocks of this chunk some earlier request had (upper bound)


class PrefixHasher:
    """Chained block hashes of synthesized trace prompts, computed once per distinct
    (parent hash, hash id): a chunk's hashes depend only on these two."""

    def __init__(self, block_size: int = BLOCK_SIZE, vocab_size: int = DEFAULT_VOCAB_SIZE,
                 cache_salt: str = "") -> None:
        if block_size <= 0 or HASH_BLOCK_TOKENS % block_size:
            raise ValueError(f"block_size must divide {HASH_BLOCK_TOKENS}, got {block_size}")
        self.block_size, self.vocab_size = block_size, vocab_size
        self.root = root_hash("halfmoon-bench-trace", "none", block_size, cache_salt)
        self._chunks: dict[tuple[bytes, int], _Chunk] = {}

    def __len__(self) -> int:
        return len(self._chunks)

    def chunks(self, request: TraceRequest) -> list[_Chunk]:
        """The request's chunks, one per hash id, computing the missing ones."""
        parent, out = self.root, []
        for hash_id in request.hash_ids:
            chunk = self._chunks.get((parent, hash_id))
            if chunk is None:
                # An ndarray, not a list: block_hash's np.asarray then takes slices without a copy.
                tokens = cast(Sequence[int], block_tokens(hash_id, self.vocab_size))
                hashes = block_hashes(tokens, self.block_size, parent)
                chunk = self._chunks[parent, hash_id] = _Chunk(b"".join(hashes), hashes[-1])
            out.append(chunk)
            parent = chunk.last
        return out

    def hashes(self, request: TraceRequest) -> list[bytes]:
        """Hashes of every full block of the request's prompt (= block_hashes of its tokens)."""
        blob = b"".join(chunk.blob for chunk in self.chunks(request))
        end = request.input_length // self.block_size * HASH_BYTES
        return [blob[i:i + HASH_BYTES] for i in range(0, end, HASH_BYTES)]


def usable_blocks(request: TraceRequest, block_size: int) -> int:
    """Blocks that can hit: the last prompt token is always recomputed (engine/scheduler.py)."""
    return (request.input_length - 1) // block_size


class Bound(NamedTuple):
    """Infinite-cache prefix reuse of a trace, in prompt tokens."""

    hit_tokens: int  # 16-token blocks, capped like the replay
    hit_tokens_512: int  # leading hash ids seen before (bench/data/README.md)
    prompt_tokens: int
    seconds: float  # hashing every distinct chunk + this pass


def upper_bound(requests: Sequence[TraceRequest], hasher: PrefixHasher) -> Bound:
    """One pass over the trace: each request's leading blocks seen in earlier requests."""
    per_chunk = HASH_BLOCK_TOKENS // hasher.block_size
    hit = hit_512 = prompt = 0
    seen_ids: set[int] = set()
    start = time.perf_counter()
    for request in requests:
        full, broken, run = request.input_length // hasher.block_size, False, 0
        for i, chunk in enumerate(hasher.chunks(request)):
            want = min(per_chunk, full - i * per_chunk)
            if not broken:
                run += min(chunk.seen, want)
                broken = chunk.seen < want
            chunk.seen = max(chunk.seen, want)
        hit += min(run, usable_blocks(request, hasher.block_size)) * hasher.block_size
        hit_512 += _leading_ids_seen(request, seen_ids)
        prompt += request.input_length
    return Bound(hit, hit_512, prompt, time.perf_counter() - start)


def _leading_ids_seen(request: TraceRequest, seen: set[int]) -> int:
    """Tokens of the request's leading hash ids seen before; then marks all its ids seen."""
    run = 0
    while run < len(request.hash_ids) and request.hash_ids[run] in seen:
        run += 1
    seen.update(request.hash_ids)
    return min(run * HASH_BLOCK_TOKENS, request.input_length)


# ---------------------------------------------------------------- replay through the pool


class TieredReplay:
    """A worker's `TieredCache` (sim/tiers.py) fed one request at a time, each holding its
    blocks as the module docstring says."""

    def __init__(self, capacity: Capacity, block_size: int = BLOCK_SIZE, running: int = 0,
                 tpot_ms: float = 50.0) -> None:
        self.block_size, self.max_running, self.tpot_ms = block_size, running, tpot_ms
        self.cache = TieredCache(capacity, block_size)
        self.pool, self.host, self.disk = self.cache.pool, self.cache.host, self.cache.disk
        self._running: list[tuple[float, int, list[int]]] = []  # heap: (finish ms, seq, table)
        self._seq = 0

    def serve(self, request: TraceRequest, hashes: list[bytes]) -> Hits:
        """Admit one request (longest prefix on device, then host/disk), register its full
        blocks, hold or free its block table."""
        self._release_finished(request.timestamp)
        self._make_room(request, hashes)
        table, hits = self.cache.acquire(hashes, request.input_length)
        self._hold(table, request)
        return hits

    def _make_room(self, request: TraceRequest, hashes: list[bytes]) -> None:
        """Release running requests (finishing first) until the prompt's blocks and a slot are free."""
        while self._running and (len(self._running) >= self.max_running or
                                 not self.cache.can_acquire(hashes, request.input_length)):
            self._release_next()

    def _hold(self, table: list[int], request: TraceRequest) -> None:
        if self.max_running == 0:
            self.cache.release(table)
            return
        finish = request.timestamp + request.output_length * self.tpot_ms
        heapq.heappush(self._running, (finish, self._seq, table))
        self._seq += 1

    def _release_finished(self, now: float) -> None:
        while self._running and self._running[0][0] <= now:
            self._release_next()

    def _release_next(self) -> None:
        self.cache.release(heapq.heappop(self._running)[2])

    def finish(self) -> None:
        """Release every running request and check every tier's bookkeeping."""
        while self._running:
            self._release_next()
        self.cache.check_integrity()
        if self.pool.num_free() != self.pool.num_blocks:
            raise PoolIntegrityError(f"{self.pool.num_used()} blocks leaked by the replay")


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """How to replay: concurrency model and tier sizes relative to the device."""

    running: int = 0
    tpot_ms: float = 50.0
    host_ratio: int = 4
    disk_ratio: int = 16

    def capacity(self, device_blocks: int) -> Capacity:
        return Capacity(device_blocks, self.host_ratio * device_blocks,
                        self.disk_ratio * device_blocks)


def replay(requests: Sequence[TraceRequest], hasher: PrefixHasher, capacity: Capacity,
           config: ReplayConfig) -> dict[str, Any]:
    """Replay the trace at one capacity; hit tokens per tier, hit rate, speed."""
    sim = TieredReplay(capacity, hasher.block_size, config.running, config.tpot_ms)
    blocks = [0, 0, 0]
    start = time.perf_counter()
    for request in requests:
        hits = sim.serve(request, hasher.hashes(request))
        for tier, n in enumerate((hits.device, hits.host, hits.disk)):
            blocks[tier] += n
    seconds = time.perf_counter() - start
    sim.finish()
    prompt = sum(r.input_length for r in requests)
    tokens = [n * hasher.block_size for n in blocks]
    return {"device_blocks": capacity.device, "host_blocks": capacity.host,
            "disk_blocks": capacity.disk, "prompt_tokens": prompt, "hit_tokens": sum(tokens),
            "device_tokens": tokens[0], "host_tokens": tokens[1], "disk_tokens": tokens[2],
            "hit_rate": sum(tokens) / prompt, "device_evictions": sim.pool.num_evictions,
            "host_evictions": sim.host.evictions, "disk_evictions": sim.disk.evictions,
            "seconds": round(seconds, 3), "requests_per_s": round(len(requests) / seconds, 1),
            "mtokens_per_s": round(prompt / seconds / 1e6, 2)}


def run_replay(requests: Sequence[TraceRequest], capacities: Sequence[int], config: ReplayConfig,
               progress: Progress) -> dict[str, Any]:
    """Upper bound, then one replay per capacity large enough for the longest prompt."""
    hasher = PrefixHasher()
    bound = upper_bound(requests, hasher)
    progress(f"upper bound + hashing {len(hasher)} distinct 512-token blocks: "
             f"{bound.seconds:.1f} s")
    longest = max(cdiv(r.input_length, BLOCK_SIZE) for r in requests)
    runs, skipped = [], []
    for device in capacities:
        if device < longest:
            skipped.append({"device_blocks": device, "reason": f"the longest prompt needs "
                            f"{longest} blocks at once"})
            continue
        runs.append(replay(requests, hasher, config.capacity(device), config))
        progress(f"replayed at {device} device blocks: hit rate {runs[-1]['hit_rate']:.4f}, "
                 f"{runs[-1]['requests_per_s']} req/s")
    if not runs:
        raise BenchInputError(f"no capacity holds the longest prompt ({longest} blocks of "
                         f"{BLOCK_SIZE} tokens): pass larger --capacities")
    return {"requests": len(requests), "prompt_tokens": bound.prompt_tokens,
            "upper_bound": bound.hit_tokens / bound.prompt_tokens,
            "upper_bound_512": bound.hit_tokens_512 / bound.prompt_tokens,
            "upper_bound_pass_s": round(bound.seconds, 3), "distinct_chunks": len(hasher),
            "capacities": runs, "skipped": skipped, "block_size": BLOCK_SIZE,
            "running": config.running, "tpot_ms": config.tpot_ms,
            "host_ratio": config.host_ratio, "disk_ratio": config.disk_ratio}
