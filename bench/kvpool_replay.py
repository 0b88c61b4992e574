"""The hit-rate replay of `halfmoon bench kvpool` (its figure 3).

Prompts are synthesized from `hash_ids` (bench.trace) and hashed into chained 16-token block
hashes with kvpool.block_hash. Equal hash-id prefixes give equal block-hash prefixes, so the
hashes of a 512-token block are computed once per (parent hash, hash id) and cached
(`PrefixHasher`, ~0.6 KB per distinct 512-token block); the same cache carries the upper bound.

    device  kvpool.block_pool.BlockPool (the real one: prefix cache, refcounts, lazy LRU
            eviction, tail-first free); its on_evict demotes to
    host    HashLRU, capacity host_blocks; its evictions demote to
    disk    HashLRU, capacity disk_blocks; its evictions are dropped.

`HashLRU` is a bookkeeping-only LRU of block hashes with the semantics of HostArena and DiskTier
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
request, capped like the replay; `upper_bound_512` is the shared/data README's figure (leading
hash ids seen before, in tokens, uncapped), for reference.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from bench.report import Progress
from bench.trace import DEFAULT_VOCAB_SIZE, HASH_BLOCK_TOKENS, TraceRequest, block_tokens
from core.blocks import cdiv
from kvpool.block_hash import HASH_BYTES, block_hashes, root_hash
from kvpool.block_pool import BlockPool
from kvpool.errors import PoolIntegrityError

BLOCK_SIZE = 16


class BenchInputError(ValueError):
    """The benchmark cannot run on what it was given (missing trace, capacities too small)."""


# ---------------------------------------------------------------- bookkeeping-only tiers


class HashLRU:
    """Bookkeeping-only LRU of block hashes: a host or disk tier without the bytes.

    Same verbs and eviction rule as HostArena/DiskTier: `put` of a held hash only touches it; a
    new hash evicts the least recently used unpinned one; when nothing can be evicted (capacity
    0, or all pinned) the new hash is not stored. A pinned hash met at the LRU head moves to the
    most recent end (O(1) amortized instead of a scan past it): pins are only held while the
    reader is about to touch those hashes anyway, which puts them there. Invariant: len <=
    capacity, pins only on held hashes.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self._pins: dict[bytes, int] = {}
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def put(self, key: bytes) -> bytes | None:
        """Store (or touch) `key`; return the hash that leaves the tier: the evicted one, or
        `key` itself when it cannot be stored, or None."""
        if key in self._lru:
            self._lru.move_to_end(key)
            return None
        victim = None
        if len(self._lru) >= self.capacity:
            victim = self._evict()
            if victim is None:
                return key
        self._lru[key] = None
        return victim

    def _evict(self) -> bytes | None:
        """Drop and return the least recently used unpinned hash (None if there is none)."""
        for _ in range(len(self._pins) + 1):
            if not self._lru:
                return None
            victim, _ = self._lru.popitem(last=False)
            if victim not in self._pins:
                self.evictions += 1
                return victim
            self._lru[victim] = None  # pinned: to the most recent end, see the class doc
        return None

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark held `keys` used, tail first (so a prompt's head is evicted last), like a get."""
        for key in reversed(keys):
            if key in self._lru:
                self._lru.move_to_end(key)

    def pin(self, keys: Iterable[bytes]) -> list[bytes]:
        """Pin the held `keys` against eviction; returns what to `unpin`."""
        pinned = [key for key in keys if key in self._lru]
        for key in pinned:
            self._pins[key] = self._pins.get(key, 0) + 1
        return pinned

    def unpin(self, keys: Iterable[bytes]) -> None:
        """Drop one pin per key (each must be pinned: KeyError otherwise)."""
        for key in keys:
            left = self._pins.pop(key) - 1
            if left:
                self._pins[key] = left

    def check_integrity(self) -> None:
        """Raise PoolIntegrityError unless len <= capacity and every pin is on a held hash."""
        if len(self._lru) > self.capacity or any(k not in self._lru for k in self._pins):
            raise PoolIntegrityError(f"HashLRU holds {len(self._lru)} of {self.capacity} "
                                     f"with {len(self._pins)} pins")


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
    hit_tokens_512: int  # leading hash ids seen before (shared/data README)
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


@dataclass(frozen=True, slots=True)
class Capacity:
    """Tier sizes in blocks of BLOCK_SIZE tokens."""

    device: int
    host: int
    disk: int


class Hits(NamedTuple):
    """Blocks of one request served by each tier."""

    device: int
    host: int
    disk: int


class TieredReplay:
    """A device BlockPool whose evictions demote to a host then a disk HashLRU."""

    def __init__(self, capacity: Capacity, block_size: int = BLOCK_SIZE, running: int = 0,
                 tpot_ms: float = 50.0) -> None:
        self.block_size, self.max_running, self.tpot_ms = block_size, running, tpot_ms
        self.pool = BlockPool(capacity.device)
        self.host, self.disk = HashLRU(capacity.host), HashLRU(capacity.disk)
        self.pool.on_evict = self._demote
        self._running: list[tuple[float, int, list[int]]] = []  # heap: (finish ms, seq, table)
        self._seq = 0

    def _demote(self, block_id: int, block_hash: bytes) -> None:
        """BlockPool.on_evict: device -> host; what the host evicts goes to disk."""
        leaving = self.host.put(block_hash)
        if leaving is not None:
            self.disk.put(leaving)  # what the disk evicts is gone

    def serve(self, request: TraceRequest, hashes: list[bytes]) -> Hits:
        """Admit one request (longest prefix on device, then host/disk), register its full
        blocks, hold or free its block table."""
        self._release_finished(request.timestamp)
        usable = hashes[:usable_blocks(request, self.block_size)]
        hit = self.pool.get_computed_blocks(usable)
        from_host, from_disk = self._match_lower(usable[len(hit):])
        need = cdiv(request.input_length, self.block_size) - len(hit)
        self._make_room(need, hit)
        table = self._admit(hit, from_host, from_disk, need, hashes)
        self._hold(table, request)
        return Hits(len(hit), len(from_host), len(from_disk))

    def _match_lower(self, rest: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Leading blocks of `rest` in host or disk (KVTiers.match), split by where they are
        read from (host first, as KVTiers.load)."""
        from_host, from_disk = [], []
        for key in rest:
            if key in self.host:
                from_host.append(key)
            elif key in self.disk:
                from_disk.append(key)
            else:
                break
        return from_host, from_disk

    def _admit(self, hit: list[int], from_host: list[bytes], from_disk: list[bytes],
               need: int, hashes: list[bytes]) -> list[int]:
        self.pool.touch(hit)
        pinned = self.host.pin(from_host), self.disk.pin(from_disk)
        new = self.pool.allocate(need)  # may demote others; our host/disk blocks are pinned
        self.host.unpin(pinned[0])
        self.disk.unpin(pinned[1])
        self.host.touch(from_host)
        self.disk.touch(from_disk)
        self.pool.cache_blocks(new[:len(hashes) - len(hit)], hashes[len(hit):])
        return hit + new

    def _make_room(self, need: int, hit: list[int]) -> None:
        """Release running requests (finishing first) until `need` blocks and a slot are free."""
        while self._running and (len(self._running) >= self.max_running or
                                 self.pool.num_free() - self.pool.num_free_among(hit) < need):
            self._release_next()

    def _hold(self, table: list[int], request: TraceRequest) -> None:
        if self.max_running == 0:
            self.pool.free(table)
            return
        finish = request.timestamp + request.output_length * self.tpot_ms
        heapq.heappush(self._running, (finish, self._seq, table))
        self._seq += 1

    def _release_finished(self, now: float) -> None:
        while self._running and self._running[0][0] <= now:
            self._release_next()

    def _release_next(self) -> None:
        self.pool.free(heapq.heappop(self._running)[2])

    def finish(self) -> None:
        """Release every running request and check every tier's bookkeeping."""
        while self._running:
            self._release_next()
        self.pool.check_integrity()
        if self.pool.num_free() != self.pool.num_blocks:
            raise PoolIntegrityError(f"{self.pool.num_used()} blocks leaked by the replay")
        self.host.check_integrity()
        self.disk.check_integrity()


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
        for tier, n in enumerate(sim.serve(request, hasher.hashes(request))):
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
