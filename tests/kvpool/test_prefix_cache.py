"""Device prefix cache in BlockPool: exact ids, lazy LRU eviction, demotion hook, integrity."""

from __future__ import annotations

import random

import pytest

from halfmoon.kvpool.block_pool import BlockPool
from halfmoon.kvpool.errors import BlockStateError


def H(i: int) -> bytes:
    return i.to_bytes(16, "little")


class Checked:
    """The pool with check_integrity() after every verb (same idea as test_block_pool)."""

    def __init__(self, n: int) -> None:
        self.pool = BlockPool(n)
        self.evicted: list[tuple[int, bytes]] = []
        self.pool.on_evict = lambda block_id, h: self.evicted.append((block_id, h))

    def __getattr__(self, name: str):
        verb = getattr(self.pool, name)

        def checked(*args, **kwargs):
            try:
                return verb(*args, **kwargs)
            finally:
                self.pool.check_integrity()
        return checked


def test_hit_after_free_and_touch_pulls_blocks_out_of_the_free_queue() -> None:
    p = Checked(6)
    ids = p.allocate(3)
    p.cache_blocks(ids[:2], [H(1), H(2)])  # the third block is partial: never cached
    p.free(ids)
    assert p.pool.num_free() == 6 and p.pool.num_cached() == 2
    assert p.get_computed_blocks([H(1), H(2), H(3)]) == [0, 1]
    assert p.get_computed_blocks([H(2)]) == [1]  # a lookup is by hash; chaining is the caller's job
    p.touch([0, 1])
    assert p.pool.ref_cnt(0) == 1 and p.pool.num_free() == 4
    assert p.pool._free.ids() == [3, 4, 5, 2]


def test_cached_free_blocks_are_evicted_lazily_in_free_order_with_the_hook() -> None:
    p = Checked(4)
    a = p.allocate(2)
    p.cache_blocks(a, [H(10), H(11)])
    p.free(a)  # tail first: queue [2, 3, 1, 0]
    assert p.allocate(2) == [2, 3] and p.evicted == []
    assert p.allocate(1) == [1]  # reuses the cached tail block: evicted now, not at free time
    assert p.evicted == [(1, H(11))]
    assert p.get_computed_blocks([H(10), H(11)]) == [0]
    assert p.pool.num_evictions == 1


def test_touch_of_a_used_cached_block_shares_it() -> None:
    p = Checked(4)
    a = p.allocate(1)
    p.cache_blocks(a, [H(5)])
    p.touch(p.get_computed_blocks([H(5)]))
    assert p.pool.ref_cnt(a[0]) == 2
    p.free(a)
    p.free(a)
    assert p.pool.num_free() == 4 and p.pool.num_cached() == 1


def test_first_holder_of_a_hash_wins_and_errors_change_nothing() -> None:
    p = Checked(4)
    a, b = p.allocate(1), p.allocate(1)
    p.cache_blocks(a, [H(7)])
    p.cache_blocks(b, [H(7)])  # duplicate content computed twice: b stays uncached
    assert p.get_computed_blocks([H(7)]) == a and p.pool.num_cached() == 1
    with pytest.raises(BlockStateError):
        p.cache_blocks(a, [H(8)])
    with pytest.raises(BlockStateError):
        p.touch(b)  # not cached
    p.free(b)
    with pytest.raises(BlockStateError):
        p.cache_blocks(b, [H(9)])  # free blocks can't be registered


def test_random_requests_with_prefix_sharing_never_leak() -> None:
    rng = random.Random(0)
    p = Checked(24)
    live: list[list[int]] = []
    for _ in range(1500):
        if live and (rng.random() < 0.45 or not p.pool.can_allocate(4)):
            p.free(live.pop(rng.randrange(len(live))))
            continue
        prefix = rng.randrange(4)  # requests share prefixes H(0..3) of a "system prompt"
        hashes = [H(i) for i in range(prefix)] + [H(1000 + rng.randrange(50))]
        hit = p.get_computed_blocks(hashes[:prefix])
        if p.pool.num_free() - p.pool.num_free_among(hit) < len(hashes) - len(hit):
            continue
        p.touch(hit)
        table = hit + p.allocate(len(hashes) - len(hit))
        p.cache_blocks(table, hashes)
        live.append(table)
    for table in live:
        p.free(table)
    assert p.pool.num_free() == 24
    assert p.pool.num_evictions == len(p.evicted) > 0
