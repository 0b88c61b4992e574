"""The device tier: the paged KV tensor (HBM on a GPU, DRAM for the CPU runner) above the host
arena and the disk, and what it may take of the device's memory.

    device memory (or this worker's share of it, `gpu_memory_fraction`):
    | weights | KV tier: num_blocks x block_bytes (+ one pad block with CUDA graphs) | reserve |
                                                  activations, graph pool, CUDA context ^

`DeviceBudget.check` refuses a KV tier that does not fit before anything is allocated (the
message says which flag to lower); `DeviceTier` accounts the blocks: free, cached (free but
still holding a prefix) and used, `free + used == total`, and its bytes on the device. The code
is device-agnostic: it reads shapes and the pool, never the memory, so the CPU tests run it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from halfmoon.core.errors import ConfigError
from halfmoon.kvpool.block_pool import BlockPool
from halfmoon.kvpool.errors import PoolIntegrityError

GIB = 2**30
# What a worker keeps off the KV tier for activations, the CUDA graphs' pool and the context:
# a share of the device memory, at least MIN_RESERVE_BYTES.
RESERVE_SHARE = 0.1
MIN_RESERVE_BYTES = 1 * GIB


@dataclass(frozen=True, slots=True)
class DeviceBudget:
    """One worker's device memory: `device_bytes` total, `fraction` of it this worker's (0 or 1:
    all), `weights_bytes` taken by its weights."""

    device_bytes: int
    fraction: float
    weights_bytes: int

    @property
    def share_bytes(self) -> int:
        return int(self.device_bytes * (self.fraction or 1.0))

    @property
    def reserve_bytes(self) -> int:
        return max(MIN_RESERVE_BYTES, int(self.share_bytes * RESERVE_SHARE))

    @property
    def kv_bytes_max(self) -> int:
        """The largest KV tier that fits beside the weights and the reserve (0: none does)."""
        return max(0, self.share_bytes - self.weights_bytes - self.reserve_bytes)

    def check(self, kv_bytes: int) -> None:
        """ConfigError unless a KV tier of `kv_bytes` fits."""
        if kv_bytes > self.kv_bytes_max:
            raise ConfigError(
                f"the KV cache needs {kv_bytes / GIB:.2f} GiB but this worker's GPU share has "
                f"{self.kv_bytes_max / GIB:.2f} GiB for it ({self.share_bytes / GIB:.2f} GiB share, "
                f"{self.weights_bytes / GIB:.2f} GiB weights, {self.reserve_bytes / GIB:.2f} GiB reserve): "
                "lower --kv-cache-gb (or --num-blocks), or give the worker a GPU of its own")


class DeviceUsage(NamedTuple):
    total: int  # blocks of the pool (the pad block is not one)
    used: int  # held by a request
    free: int  # reusable now; `cached` of them still hold a prefix
    cached: int
    block_bytes: int

    @property
    def bytes_used(self) -> int:
        return self.used * self.block_bytes

    @property
    def bytes_total(self) -> int:
        return self.total * self.block_bytes


class DeviceTier:
    """Accounting of the KV tensor's blocks through the engine's block pool."""

    def __init__(self, kv_cache: torch.Tensor, pool: BlockPool, pad_blocks: int = 0) -> None:
        """`pad_blocks`: blocks of `kv_cache` past the pool's (CUDA graphs' padding rows)."""
        self.kv_cache = kv_cache
        self.pool = pool
        self.pad_blocks = pad_blocks
        layers, two, _, block_size, kv_heads, head_dim = kv_cache.shape
        self.block_bytes = layers * two * block_size * kv_heads * head_dim * kv_cache.element_size()

    @property
    def device(self) -> torch.device:
        return self.kv_cache.device

    def usage(self) -> DeviceUsage:
        """Blocks by state: cached counts the free blocks still holding a prefix."""
        free = self.pool.num_free()
        held_cached = self.pool.num_cached() - self._cached_used()
        return DeviceUsage(self.pool.num_blocks, self.pool.num_used(), free, held_cached, self.block_bytes)

    def _cached_used(self) -> int:
        """Cached blocks a request holds (O(num_blocks): accounting, not the hot path)."""
        return sum(1 for h in self.pool.cached_hashes()
                   if self.pool.ref_cnt(self.pool.get_computed_blocks([h])[0]) > 0)

    def check_integrity(self) -> None:
        """The pool's own invariants, free + used == total, cached <= free, and the tensor holds
        exactly the pool's blocks plus the pad blocks."""
        self.pool.check_integrity()
        u = self.usage()
        if u.free + u.used != u.total or not 0 <= u.cached <= u.free:
            raise PoolIntegrityError(f"device tier: free {u.free} + used {u.used} != total {u.total} "
                                     f"or cached {u.cached} not within free")
        if self.kv_cache.shape[2] != u.total + self.pad_blocks:
            raise PoolIntegrityError(f"device tier: the KV tensor has {self.kv_cache.shape[2]} blocks for a pool of "
                                     f"{u.total} and {self.pad_blocks} pad blocks")
