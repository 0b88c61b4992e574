"""Tier records of a tensor-parallel engine (kvpool/tiered.py): one record per block holds every
rank's shard, rank by rank; spill and reload move each shard back into its own cache, and the
tiers' checksums cover every shard of the record."""

from __future__ import annotations

import os

import pytest
import torch

from halfmoon.kvpool.block_pool import BlockPool
from halfmoon.kvpool.host_tier import HostArena
from halfmoon.kvpool.tiered import KVTiers, check_shards, kv_block_bytes
from tests.kvpool.tier_support import key

# layers, K/V, blocks, block_size, kv_heads, head_dim: rank 0 holds 2 KV heads, rank 1 one (3 over 2)
RANK0, RANK1 = (2, 2, 8, 4, 2, 4), (2, 2, 8, 4, 1, 4)


def shards() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(*RANK0, generator=g), torch.randn(*RANK1, generator=g)]


def test_a_record_is_every_ranks_block_in_rank_order() -> None:
    kv = shards()
    tiers = KVTiers(kv, BlockPool(8), None, None, write_behind=False)
    assert tiers.block_bytes == kv_block_bytes(kv) == (2 * 2 * 4 * 3 * 4) * 4
    rows = tiers.read_blocks([5, 2])
    first = kv[0][:, :, 5].contiguous().view(-1).view(torch.uint8)
    second = kv[1][:, :, 5].contiguous().view(-1).view(torch.uint8)
    assert torch.equal(rows[0], torch.cat([first, second]))
    copy = [torch.zeros_like(s) for s in kv]
    KVTiers(copy, BlockPool(8), None, None, write_behind=False).write_blocks([1, 6], rows)
    for mine, theirs in zip(copy, kv):
        assert torch.equal(mine[:, :, 1], theirs[:, :, 5]) and torch.equal(mine[:, :, 6], theirs[:, :, 2])
        assert not mine[:, :, 0].any()  # nothing else written


def test_spill_and_reload_move_every_shard_and_the_checksum_covers_them() -> None:
    kv = shards()
    pool = BlockPool(8)
    host = HostArena.create(f"hm-tp-records-{os.getpid()}", 4, kv_block_bytes(kv))
    try:
        tiers = KVTiers(kv, pool, host, None, write_behind=False)
        (b,) = pool.allocate(1)
        pool.cache_blocks([b], [key(1)])
        original = [s[:, :, b].clone() for s in kv]
        pool.free([b])
        pool.allocate(8)  # evicts the cached block: one record in the arena
        assert tiers.traffic.demoted_to_host == 1
        for s in kv:
            s[:, :, b] = 0
        assert tiers.load([key(1)], [b]) == 1
        assert all(torch.equal(s[:, :, b], o) for s, o in zip(kv, original))  # rank 1's shard too
        host.check_integrity()
        # a flipped byte in rank 1's part of the record (its last byte) is a miss, dropped,
        # never a block with a wrong shard
        assert host.contains([key(1)]) == [True]
        kv[1][:, :, b] = 0
        host._data[host._lookup(key(1)), -1] ^= 0x01
        assert tiers.load([key(1)], [b]) == 0
        assert not kv[1][:, :, b].any() and host.stats.corrupt_drops == 1
        host.check_integrity()
    finally:
        host.release()


def test_shards_of_other_blocks_or_shapes_are_refused() -> None:
    check_shards(shards(), 8)
    with pytest.raises(ValueError, match="rank 1"):
        check_shards([torch.zeros(*RANK0), torch.zeros(2, 2, 4, 4, 1, 4)], 8)  # too few blocks
    with pytest.raises(ValueError, match="does not match rank 0"):
        check_shards([torch.zeros(*RANK0), torch.zeros(2, 2, 8, 8, 1, 4)], 8)  # another block size
    with pytest.raises(ValueError, match="does not match rank 0"):
        check_shards([torch.zeros(*RANK0), torch.zeros(*RANK1, dtype=torch.bfloat16)], 8)
