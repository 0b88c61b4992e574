"""The device tier (kvpool/device_tier.py): its memory budget, its block accounting with
check_integrity, and the tiers below it keeping their rows on the host whatever torch's default
device is (an engine on CUDA runs its steps under `torch.device("cuda")`; here the `meta`
device stands in for it: a buffer that followed the default would be a meta tensor and fail)."""

from __future__ import annotations

import os

import pytest
import torch

from halfmoon.core.errors import ConfigError
from halfmoon.kvpool.block_pool import BlockPool
from halfmoon.kvpool.device_tier import GIB, MIN_RESERVE_BYTES, DeviceBudget, DeviceTier
from halfmoon.kvpool.errors import PoolIntegrityError
from halfmoon.kvpool.host_tier import HostArena
from halfmoon.kvpool.tiered import KVTiers
from tests.kvpool.tier_support import key

SHAPE = (2, 2, 8, 4, 1, 4)  # layers, K/V, blocks, block_size, kv_heads, head_dim (fp32: 256 B a block)


def test_budget_leaves_weights_and_a_reserve() -> None:
    budget = DeviceBudget(device_bytes=80 * GIB, fraction=0.0, weights_bytes=16 * GIB)
    assert budget.share_bytes == 80 * GIB and budget.reserve_bytes == 8 * GIB
    assert budget.kv_bytes_max == 56 * GIB
    budget.check(56 * GIB)
    with pytest.raises(ConfigError, match="lower --kv-cache-gb"):
        budget.check(57 * GIB)


def test_a_shared_gpu_budget_is_the_workers_fraction() -> None:
    budget = DeviceBudget(device_bytes=80 * GIB, fraction=0.46, weights_bytes=2 * GIB)
    assert budget.share_bytes == int(80 * GIB * 0.46)
    assert budget.kv_bytes_max == budget.share_bytes - 2 * GIB - budget.reserve_bytes
    small = DeviceBudget(device_bytes=4 * GIB, fraction=0.5, weights_bytes=GIB)
    assert small.reserve_bytes == MIN_RESERVE_BYTES and small.kv_bytes_max == 0
    with pytest.raises(ConfigError):
        small.check(1)


def test_accounting_follows_the_pool() -> None:
    kv = torch.zeros(*SHAPE)
    pool = BlockPool(7)  # the tensor's 8th block is the CUDA graphs' pad block
    tier = DeviceTier(kv, pool, pad_blocks=1)
    assert tier.block_bytes == 2 * 2 * 4 * 1 * 4 * 4
    tier.check_integrity()
    assert tier.usage()[:4] == (7, 0, 7, 0)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks[:2], [key(0), key(1)])
    assert tier.usage()[:4] == (7, 3, 4, 0)
    pool.free(blocks)
    u = tier.usage()
    assert u[:4] == (7, 0, 7, 2)  # two free blocks still hold a prefix
    assert u.bytes_total == 7 * tier.block_bytes and u.bytes_used == 0
    tier.check_integrity()


def test_integrity_catches_a_tensor_that_does_not_match_the_pool() -> None:
    with pytest.raises(PoolIntegrityError, match="pad blocks"):
        DeviceTier(torch.zeros(*SHAPE), BlockPool(8), pad_blocks=1).check_integrity()


def test_tiers_keep_host_rows_on_the_host_whatever_the_default_device() -> None:
    kv = torch.randn(*SHAPE)
    pool = BlockPool(8)
    block_bytes = kv[:, :, 0].numel() * kv.element_size()
    host = HostArena.create(f"hm-devtier-{os.getpid()}", 4, block_bytes)
    try:
        tiers = KVTiers(kv, pool, host, None, write_behind=False)
        (b,) = pool.allocate(1)
        pool.cache_blocks([b], [key(7)])
        original = kv[:, :, b].clone()
        pool.free([b])
        with torch.device("meta"):
            rows = tiers.read_blocks([b])
            assert rows.device.type == "cpu"
            pool.allocate(8)  # evicts the cached block: spilled to the host arena
            assert tiers.traffic.demoted_to_host == 1
            kv[:, :, b] = 0
            assert tiers.load([key(7)], [b]) == 1  # promoted back into the device tier
        assert torch.equal(kv[:, :, b], original)
        host.check_integrity()
    finally:
        host.release()


def test_a_spill_batch_larger_than_the_arena_sends_the_rest_to_disk(tmp_path) -> None:
    """The write-behind hands the host arena whole runs of evicted blocks; the ones a small
    arena cannot take go to disk (they were dropped before: a timing-dependent miss)."""
    from halfmoon.kvpool.disk_tier import DiskTier
    from halfmoon.kvpool.tiered import _Spill

    kv = torch.randn(*SHAPE)
    block_bytes = kv[:, :, 0].numel() * kv.element_size()
    host = HostArena.create(f"hm-devtier-batch-{os.getpid()}", 2, block_bytes)
    disk = DiskTier(tmp_path / "disk", block_bytes, 16)
    try:
        tiers = KVTiers(kv, BlockPool(8), host, disk, write_behind=False)
        hashes = [key(i) for i in range(5)]
        tiers._spill(_Spill(hashes, tiers.read_blocks(range(5))))
        assert tiers.match(hashes) == 5
        assert (tiers.traffic.demoted_to_host, tiers.traffic.demoted_to_disk) == (2, 3)
        kv.zero_()
        assert tiers.load(hashes, list(range(5))) == 5 and kv[:, :, :5].any()
        host.check_integrity()
        disk.check_integrity()
    finally:
        host.release()
        disk.close()
