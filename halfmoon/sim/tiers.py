"""Bookkeeping-only KV tiers: the host and disk tiers' eviction rules without the bytes.

The simulator (and `halfmoon bench kvpool`'s replay) put the real device `BlockPool`
(kvpool/block_pool.py: prefix cache, refcounts, lazy LRU eviction) above two `HashLRU`s. The real
host and disk tiers cost ~20 us per demoted block for their bytes and checksums (minutes per
capacity for a 100M-token trace); a `HashLRU` takes well under 1 us with the same verbs and
eviction order.

`TieredCache` is one worker's prefix cache as the engine's scheduler uses it
(engine/scheduler.py): a request's usable prefix (whole blocks, never the last prompt token) is
served from the device pool, then host, then disk (promoted: pinned while the device allocates
the rest, which may demote other blocks); every full block of the prompt is registered; the
block table is held until the caller releases it.

    | device hit (get_computed_blocks) | host/disk hit (promoted) | computed | partial |
    '---------------- usable = (prompt_len - 1) // block_size blocks ---'

The simulator's caches work in the trace's 512-token blocks while the engine reuses 16-token
ones: there (`engine_block` given) every block of the prompt can hit, the partial last one
included, and a hit counts what the engine would reuse (`Hits.tokens`): the tokens the two
prompts share, in whole engine blocks, never the last prompt token. A block's identity is its
hash-id chain whatever its length (sim/workload.py): the live replay's tokens of a hash id are
the same at every length (bench/trace.py), so a prompt that ended 88 tokens into a block leaves
88 of that block's tokens cached, and a later prompt carrying the whole block (the next turn of
the conversation) reuses those 88. The cache keeps each block's `fill`, the tokens of it held:

    prompt A  | id 1: 512 | id 2: 88 |                    fill(1) = 512, fill(2) = 88
    prompt B  | id 1: 512 | id 2: 512 | id 5: 300 |       hits 512 + 88 (then computes the rest:
                                                          fill(2) = 512), stops at block 2

A block computed anew gets the prompt's fill of it; a hit can only grow it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from typing import NamedTuple

from halfmoon.core.blocks import cdiv
from halfmoon.kvpool.block_pool import BlockPool
from halfmoon.kvpool.errors import PoolIntegrityError


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


class Capacity(NamedTuple):
    """Tier sizes in blocks."""

    device: int
    host: int
    disk: int


class Hits(NamedTuple):
    """Blocks of one request served by each tier, and the prompt tokens the engine reuses from
    each (device, host, disk), as the cache held them when it matched (module doc)."""

    device: int
    host: int
    disk: int
    tokens: tuple[int, int, int] = (0, 0, 0)

    @property
    def blocks(self) -> int:
        return self.device + self.host + self.disk

    @property
    def reused(self) -> int:
        """Prompt tokens not computed: what every tier served."""
        return sum(self.tokens)


class TieredCache:
    """A device `BlockPool` whose evictions demote to a host then a disk `HashLRU` (module doc)."""

    def __init__(self, capacity: Capacity, block_size: int, engine_block: int | None = None) -> None:
        self.block_size = block_size
        self.engine_block = engine_block  # None: blocks are the engine's (module docstring)
        self.pool = BlockPool(capacity.device)
        self.host, self.disk = HashLRU(capacity.host), HashLRU(capacity.disk)
        self.pool.on_evict = self._demote
        self._fill: dict[bytes, int] = {}  # engine_block mode: tokens of each block held (module doc)

    def _demote(self, block_id: int, block_hash: bytes) -> None:
        """BlockPool.on_evict: device -> host; what the host evicts goes to disk."""
        leaving = self.host.put(block_hash)
        if leaving is not None:
            self.disk.put(leaving)  # what the disk evicts is gone

    def usable(self, prompt_len: int) -> int:
        """Blocks that can hit: the last prompt token is always recomputed (with `engine_block`,
        every block: `Hits.tokens` keeps that rule in tokens)."""
        if self.engine_block is not None:
            return cdiv(prompt_len, self.block_size)
        return (prompt_len - 1) // self.block_size

    def _hits(self, hashes: Sequence[bytes], prompt_len: int, device: int, host: int, disk: int) -> Hits:
        """Blocks served per tier with the prompt tokens the engine reuses from each, as held now."""
        cuts = (device, device + host, device + host + disk)
        if self.engine_block is None:
            ends = [min(n * self.block_size, prompt_len) for n in cuts]
        else:
            ends = self._engine_ends(hashes, prompt_len, cuts)
        return Hits(device, host, disk, (ends[0], ends[1] - ends[0], ends[2] - ends[1]))

    def _engine_ends(self, hashes: Sequence[bytes], prompt_len: int, cuts: Sequence[int]) -> list[int]:
        """For each n of `cuts` (ascending): the tokens the engine reuses when the prompt's first n
        blocks hit: what both the cache and the prompt hold of each, up to the first block either
        holds only in part (module doc); whole engine blocks, never the last prompt token."""
        assert self.engine_block is not None
        tokens, index, whole, ends = 0, 0, True, []
        for n in cuts:
            while index < n and whole:
                shared = min(self._fill.get(hashes[index], self.block_size), self._fill_of(index, prompt_len))
                tokens, index, whole = tokens + shared, index + 1, shared == self.block_size
            ends.append(min(tokens, prompt_len - 1) // self.engine_block * self.engine_block)
        return ends

    def _fill_of(self, index: int, prompt_len: int) -> int:
        """Tokens of the prompt's block `index` (the last one may be partial)."""
        return min(self.block_size, prompt_len - index * self.block_size)

    def _record_fills(self, hashes: Sequence[bytes], prompt_len: int, held: int) -> None:
        """After an acquire: the `held` leading blocks were hits (their fill can only grow), the
        rest were computed now (their fill is this prompt's)."""
        if self.engine_block is None:
            return
        for i, key in enumerate(hashes):
            fill = self._fill_of(i, prompt_len)
            self._fill[key] = max(self._fill.get(key, 0), fill) if i < held else fill

    def match(self, hashes: Sequence[bytes], prompt_len: int) -> Hits:
        """Leading blocks of the prompt held here, by tier (no side effect)."""
        usable = hashes[:self.usable(prompt_len)]
        device = len(self.pool.get_computed_blocks(usable))
        host, disk = self._match_lower(usable[device:])
        return self._hits(hashes, prompt_len, device, len(host), len(disk))

    def can_acquire(self, hashes: Sequence[bytes], prompt_len: int) -> bool:
        """Whether `acquire` finds room for the prompt's blocks now (host/disk hits need device
        blocks too: they are promoted into them)."""
        hit = self.pool.get_computed_blocks(hashes[:self.usable(prompt_len)])
        need = cdiv(prompt_len, self.block_size) - len(hit)
        return self.pool.num_free() - self.pool.num_free_among(hit) >= need

    def acquire(self, hashes: Sequence[bytes], prompt_len: int) -> tuple[list[int], Hits]:
        """Admit the prompt: its block table (held until `release`) and what each tier served."""
        usable = hashes[:self.usable(prompt_len)]
        hit = self.pool.get_computed_blocks(usable)
        from_host, from_disk = self._match_lower(usable[len(hit):])
        need = cdiv(prompt_len, self.block_size) - len(hit)
        self.pool.touch(hit)
        pinned = self.host.pin(from_host), self.disk.pin(from_disk)
        new = self.pool.allocate(need)  # may demote others; our host/disk blocks are pinned
        self.host.unpin(pinned[0])
        self.disk.unpin(pinned[1])
        self.host.touch(from_host)
        self.disk.touch(from_disk)
        self.pool.cache_blocks(new[:len(hashes) - len(hit)], hashes[len(hit):])
        hits = self._hits(hashes, prompt_len, len(hit), len(from_host), len(from_disk))  # before the fills grow
        self._record_fills(hashes, prompt_len, hits.blocks)
        return hit + new, hits

    def release(self, table: Sequence[int]) -> None:
        self.pool.free(table)

    def _match_lower(self, rest: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Leading blocks of `rest` in host or disk (KVTiers.match), split by where they are
        read from (host first, as KVTiers.load)."""
        from_host: list[bytes] = []
        from_disk: list[bytes] = []
        for key in rest:
            if key in self.host:
                from_host.append(key)
            elif key in self.disk:
                from_disk.append(key)
            else:
                break
        return from_host, from_disk

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        self.host.check_integrity()
        self.disk.check_integrity()
