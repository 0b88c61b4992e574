"""An engine's KV tiers below its device prefix cache, as configured: the node's shared host
arena (made by the first engine, attached by the others), the disk tier, the cluster index."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence

import torch

from halfmoon.engine.config import EngineConfig
from halfmoon.kvpool.block_pool import BlockPool
from halfmoon.kvpool.cluster_index import ClusterIndex, HolderId
from halfmoon.kvpool.disk_tier import DiskTier
from halfmoon.kvpool.host_tier import HostArena
from halfmoon.kvpool.remote import InProcessReader, RemoteBlockReader
from halfmoon.kvpool.tiered import KVTiers
from halfmoon.kvpool.tiered import kv_block_bytes as kv_tier_block_bytes

log = logging.getLogger(__name__)


def build_tiers(config: EngineConfig, kv_caches: Sequence[torch.Tensor], pool: BlockPool,
                remote: RemoteBlockReader | None = None, full_block_bytes: int | None = None) -> KVTiers | None:
    """Host arena, disk tier and cluster index below the device prefix cache, as configured.
    `kv_caches`: every rank's KV cache, rank 0's first (one record holds each rank's shard of a
    block: kvpool/tiered.py); `full_block_bytes`: a TP=1 engine's record of this model (default
    this one's), the size of the node's shared arena."""
    if config.host_cache_gb <= 0 and config.disk_cache_dir is None and config.redis_url is None:
        return None
    kv_cache = kv_caches[0]
    block_bytes = kv_tier_block_bytes(kv_caches)
    host = None
    if config.host_cache_gb > 0:
        slots = max(1, int(config.host_cache_gb * 2**30) // block_bytes)
        name = config.host_cache_name or f"halfmoon-{os.getpid()}-{id(kv_cache):x}"
        host = _create_or_attach(arena_name(name, config.tp, block_bytes, full_block_bytes or block_bytes),
                                 slots, block_bytes)
    disk = None
    if config.disk_cache_dir is not None:
        slots = max(1, int(config.disk_cache_gb * 2**30) // block_bytes)
        disk = DiskTier(config.disk_cache_dir, block_bytes, slots)
    index = None
    if config.redis_url is not None:
        holder = HolderId(config.worker_id or f"engine-{os.getpid()}-{id(kv_cache):x}",
                          config.node_id or socket.gethostname())
        index = ClusterIndex(config.redis_url, holder)
        index.start()  # heartbeat thread: our entries vanish from lookups if we die
    tiers = KVTiers(kv_caches, pool, host, disk, index, remote if config.remote_fetch else None)
    if index is not None and isinstance(remote, InProcessReader):
        remote.register(index.holder, tiers)
    return tiers


def arena_name(name: str, tp: int, block_bytes: int, full_block_bytes: int) -> str:
    """The node's arena for records of `block_bytes`: the shared one when they are a TP=1
    engine's size (every layout whose ranks split the KV heads), else one of its own for this
    layout (replicated KV heads: fewer than the ranks), loudly."""
    if block_bytes == full_block_bytes:
        return name
    log.warning("tp %d replicates KV heads (records of %d bytes, not %d): this worker's host tier is an "
                "arena of its own, %s-tp%d, of the same --host-cache-gb", tp, block_bytes, full_block_bytes, name, tp)
    return f"{name}-tp{tp}"


def _create_or_attach(name: str, slots: int, block_bytes: int, tries: int = 3) -> HostArena:
    """The node's arena `name`: made by the first engine, attached by the others. An arena
    its last engine is removing as we arrive is gone by our next try."""
    for _ in range(tries - 1):
        try:
            return HostArena.create(name, slots, block_bytes)
        except FileExistsError:
            pass
        try:
            return HostArena.attach(name)  # another worker of this node made it
        except FileNotFoundError:
            continue
    return HostArena.create(name, slots, block_bytes)
