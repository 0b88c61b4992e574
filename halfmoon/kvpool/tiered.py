"""Moves whole KV blocks between the device cache and the host arena and disk tier.

    device (paged KV tensor) --evict--> host arena (shared memory) --evict--> disk (slab file)
            ^                                 |                                  |
            +----------- promote on admission (host first, then disk) -----------+

A block's bytes are `kv_cache[:, :, b]` ([layers, 2, block_size, kv_heads, head_dim]) made
contiguous: the same bytes on every tier, keyed by the block's chained hash.

Under tensor parallelism (engine/tp_ranks.py) rank 0 maps every rank's KV cache (its shard: the
rank's KV heads of the same blocks), and a tier record is every shard's block, rank by rank:

    record(b) = shard_0[:, :, b] | shard_1[:, :, b] | ... | shard_{N-1}[:, :, b]   (each contiguous)

one record per (hash, layout): the layout is in the hash's root (`+tp{N}` in the KV tag), so a
record is only ever read back by an engine of the same layout, which splits it the same way.
Spilling, reloading and serving a block to another worker move every rank's shard at once.

Spills and cluster-index announcements are written behind (kvpool/write_behind.py): the engine
thread copies an evicted block's bytes to a staging row and goes on; one thread of its own puts
them in the host arena (or disk) and tells the index, in the order the engine queued them.
Promotion stays on the engine thread: the request needs the blocks before its step.

The device tier may be a GPU's (kvpool/device_tier.py): block rows below it always live on the
host (every buffer here is made with device="cpu", whatever torch's default device is), and
`read_blocks` / `write_blocks` are the only copies across.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import torch

from halfmoon.kvpool.block_pool import BlockPool
from halfmoon.kvpool.cluster_index import ClusterIndex, HolderId
from halfmoon.kvpool.disk_tier import DiskTier
from halfmoon.kvpool.host_tier import HostArena
from halfmoon.kvpool.remote import RemoteBlockReader
from halfmoon.kvpool.tier_base import EvictedBlocks
from halfmoon.kvpool.tiers import Tier
from halfmoon.kvpool.write_behind import WriteBehind

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Spill:
    """Evicted device blocks on their way down: `rows[i]` (a staged copy) holds `hashes[i]`."""

    hashes: list[bytes]
    rows: torch.Tensor


@dataclass(slots=True)
class _Announce:
    """A cluster-index call: `index.<verb>(hashes, *tiers)`."""

    verb: str
    hashes: list[bytes]
    tiers: tuple[Tier, ...]


@dataclass(slots=True)
class TierTraffic:
    """Blocks moved between tiers by this process."""

    demoted_to_host: int = 0
    demoted_to_disk: int = 0
    promoted_from_host: int = 0
    promoted_from_disk: int = 0
    fetched_remote: int = 0


class TierPlan(NamedTuple):
    """Where the blocks after a device hit come from: `lower` from host/disk, then `remote`
    more from `holder` (another worker, found in the cluster index); `rows`: those `remote`
    blocks' bytes, already pulled (`fetch_async`), else None (pull them at admission)."""

    lower: int
    remote: int = 0
    holder: HolderId | None = None
    rows: torch.Tensor | None = None

    @property
    def total(self) -> int:
        return self.lower + self.remote


class Prefetched(NamedTuple):
    """A finished remote pull: `count` leading blocks of `hashes` verified in `rows`; the
    blocks start at index `start` of the request's chain."""

    start: int
    hashes: tuple[bytes, ...]
    rows: torch.Tensor
    count: int


def kv_block_bytes(kv_cache: torch.Tensor | Sequence[torch.Tensor]) -> int:
    """One tier record's bytes: a block of the cache (of every shard, when given several)."""
    if isinstance(kv_cache, torch.Tensor):
        layers, two, _, block_size, kv_heads, head_dim = kv_cache.shape
        return layers * two * block_size * kv_heads * head_dim * kv_cache.element_size()
    return sum(kv_block_bytes(shard) for shard in kv_cache)


def check_shards(shards: Sequence[torch.Tensor], num_blocks: int) -> None:
    """ValueError unless the shards are caches of the same blocks: [layers, 2, >= num_blocks,
    block_size, heads, head_dim] with layers, block size, head_dim and dtype alike."""
    if not shards:
        raise ValueError("a KV tier needs at least one KV cache")
    first = shards[0]
    for rank, shard in enumerate(shards):
        if shard.dim() != 6 or shard.shape[2] < num_blocks:
            raise ValueError(f"KV shard of rank {rank}: shape {tuple(shard.shape)} is not "
                             f"[layers, 2, >= {num_blocks} blocks, block_size, heads, head_dim]")
        same = (shard.shape[:2], shard.shape[3], shard.shape[5], shard.dtype) == \
               (first.shape[:2], first.shape[3], first.shape[5], first.dtype)
        if not same:
            raise ValueError(f"KV shard of rank {rank} ({tuple(shard.shape)}, {shard.dtype}) does not match "
                             f"rank 0's ({tuple(first.shape)}, {first.dtype})")


class KVTiers:
    """Device <-> host <-> disk block movement for one worker's paged KV cache."""

    def __init__(self, kv_cache: torch.Tensor | Sequence[torch.Tensor], pool: BlockPool, host: HostArena | None,
                 disk: DiskTier | None, index: ClusterIndex | None = None,
                 remote: RemoteBlockReader | None = None, write_behind: bool = True) -> None:
        """`kv_cache`: the paged KV tensor, or a tensor-parallel engine's every shard, rank 0's
        first (a record holds each: module doc). `write_behind`: spills and index announcements
        on a thread of their own (module doc); False applies them on the caller's thread at
        once (tests of exact tier states)."""
        self.shards = [kv_cache] if isinstance(kv_cache, torch.Tensor) else list(kv_cache)
        check_shards(self.shards, pool.num_blocks)
        self.kv_cache = self.shards[0]
        self.shard_bytes = [kv_block_bytes(shard) for shard in self.shards]
        self.block_bytes = sum(self.shard_bytes)
        for tier in (host, disk):
            if tier is not None and tier.slot_bytes != self.block_bytes:
                raise ValueError(f"tier slot_bytes {tier.slot_bytes} != KV block bytes {self.block_bytes}")
        self.host, self.disk = host, disk
        self.pool = pool
        self.index, self.remote = index, remote
        self.traffic = TierTraffic()
        self._puller: ThreadPoolExecutor | None = None  # remote pulls, off the engine thread
        self._writer = WriteBehind(self._apply) if write_behind and (host or disk or index) else None
        pool.on_evict = self._demote_device_block
        if host is not None and disk is not None:
            host.on_evict = self._demote_host_blocks

    # ------------------------------------------------------------ device block bytes

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Device blocks -> [n, block_bytes] uint8 host rows, every shard's block in rank order
        (one batched gather per shard; from a GPU, one copy to host, synchronous: the caller may
        reuse the blocks once this returns)."""
        parts = [_gather(shard, block_ids) for shard in self.shards]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """[n, block_bytes] uint8 host rows -> device blocks (one batched scatter per shard)."""
        start = 0
        for shard, nbytes in zip(self.shards, self.shard_bytes):
            _scatter(shard, block_ids, data[:, start : start + nbytes])
            start += nbytes

    # ------------------------------------------------------------ demotion

    def _demote_device_block(self, block_id: int, block_hash: bytes) -> None:
        """BlockPool.on_evict: the block's bytes are intact only until the engine reuses the
        block, so they are copied now; the put one tier down is written behind."""
        if self.host is None and self.disk is None:
            self._announce("remove", [block_hash], Tier.DEVICE)
            return
        spill = _Spill([block_hash], self.read_blocks([block_id]))
        if self._writer is None:
            self._spill(spill)
        else:
            self._writer.submit(spill, staged_blocks=1)

    def _spill(self, spill: _Spill) -> None:
        """Put evicted blocks in the host arena (else the disk tier) and tell the index."""
        target = self.host if self.host is not None else self.disk
        assert target is not None
        stored = target.put(spill.hashes, spill.rows).stored
        kept = [h for h, ok in zip(spill.hashes, stored) if ok]
        if target is self.host:
            self.traffic.demoted_to_host += len(kept)
        else:
            self.traffic.demoted_to_disk += len(kept)
        self._announce("move", kept, Tier.DEVICE, Tier.HOST if target is self.host else Tier.DISK)
        missed = [i for i, ok in enumerate(stored) if not ok]
        if missed and target is self.host and self.disk is not None:
            # a batch larger than the arena: its trailing blocks go straight to disk, not away
            self._spill_to_disk([spill.hashes[i] for i in missed], spill.rows[missed])
        else:
            self._announce("remove", [spill.hashes[i] for i in missed], Tier.DEVICE)

    def _spill_to_disk(self, hashes: list[bytes], rows: torch.Tensor) -> None:
        assert self.disk is not None
        result = self.disk.put(hashes, rows)
        self.traffic.demoted_to_disk += sum(result.stored)
        self._announce("move", [h for h, ok in zip(hashes, result.stored) if ok], Tier.DEVICE, Tier.DISK)
        self._announce("remove", [h for h, ok in zip(hashes, result.stored) if not ok], Tier.DEVICE)
        self._announce("remove", result.evicted, Tier.DISK)

    def _apply(self, ops: list[object]) -> None:
        """The write-behind's batch, in order; runs of spills become one put, runs of the same
        announcement one index call. A failing run is logged and skipped (cache misses later)."""
        for run in _runs(ops):
            try:
                if isinstance(run[0], _Spill):
                    self._spill(_Spill([h for op in run for h in op.hashes], torch.cat([op.rows for op in run])))
                else:
                    first = run[0]
                    self._announce(first.verb, [h for op in run for h in op.hashes], *first.tiers)
            except Exception:
                log.exception("write-behind: %d %s ops failed; skipped", len(run), type(run[0]).__name__)

    def flush(self, timeout_s: float | None = 30.0) -> bool:
        """Wait for the spills and announcements queued so far; False on timeout."""
        return self._writer is None or self._writer.flush(timeout_s)

    def _demote_host_blocks(self, evicted: EvictedBlocks) -> None:
        """HostArena.on_evict: the views are valid only now, so the disk write is synchronous."""
        assert self.disk is not None
        result = self.disk.put(evicted.hashes, evicted.blocks, evicted.checksums)
        self.traffic.demoted_to_disk += sum(result.stored)
        moved = [h for h, ok in zip(evicted.hashes, result.stored) if ok]
        self._announce("move", moved, Tier.HOST, Tier.DISK)
        self._announce("remove", [h for h, ok in zip(evicted.hashes, result.stored) if not ok], Tier.HOST)
        self._announce("remove", result.evicted, Tier.DISK)

    # ------------------------------------------------------------ cluster index

    def published(self, hashes: Sequence[bytes]) -> None:
        """Blocks just registered in the device prefix cache: tell the cluster."""
        self._announce("publish", list(hashes), Tier.DEVICE)

    def _announce(self, verb: str, hashes: list[bytes], *tiers: Tier) -> None:
        # The index degrades by itself when Redis is down (logs once, counts, republishes later).
        if self.index is None or not hashes:
            return
        if self._writer is not None and not self._writer.on_thread():
            self._writer.submit(_Announce(verb, list(hashes), tiers))
        else:
            getattr(self.index, verb)(hashes, *tiers)

    def plan(self, usable: Sequence[bytes], device_hit: int, prefer: str | None = None) -> TierPlan:
        """After `device_hit` blocks on the device: how many more host/disk, then a remote holder, hold.
        Of the other holders with the longest match, the worker `prefer` (the router's choice)
        is read, else the first the index lists (faster tier first)."""
        lower = self.match(usable[device_hit:])
        local = device_hit + lower
        if self.index is None or self.remote is None or local >= len(usable):
            return TierPlan(lower)
        result = self.index.lookup(usable)
        others = [m for m in result.matches if m.holder != self.index.holder]
        best = max(others, key=lambda m: (m.length, m.holder.worker_id == prefer), default=None)
        if best is None or best.length <= local:
            return TierPlan(lower)
        return TierPlan(lower, best.length - local, best.holder)

    def fetch_async(self, holder: HolderId, hashes: Sequence[bytes], start: int) -> Future[Prefetched]:
        """Pull `hashes` from `holder` on a thread of its own (the engine keeps stepping); the
        future never fails: a failed pull is a `Prefetched` of the verified leading blocks."""
        assert self.remote is not None
        if self._puller is None:
            self._puller = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-pull")
        return self._puller.submit(self._pull, holder, tuple(hashes), start)

    def _pull(self, holder: HolderId, hashes: tuple[bytes, ...], start: int) -> Prefetched:
        rows = torch.empty(len(hashes), self.block_bytes, dtype=torch.uint8, device="cpu")
        try:
            got = self.remote.fetch(holder, hashes, rows)  # type: ignore[union-attr]
        except Exception as e:  # a reader must not raise; if one does, the blocks are recomputed
            log.warning("pulling %d blocks from %s failed: %s", len(hashes), holder.key, e)
            got = 0
        return Prefetched(start, hashes, rows, got)

    def plan_prefetched(self, usable: Sequence[bytes], device_hit: int, pre: Prefetched) -> TierPlan:
        """`plan` once a pull has finished: host/disk as now, then the pulled rows that continue
        the local prefix (none when the local prefix moved past them or fell short of them)."""
        lower = self.match(usable[device_hit:])
        offset = device_hit + lower - pre.start
        if not 0 <= offset < pre.count:
            return TierPlan(lower)
        remote = min(pre.count, len(usable) - pre.start) - offset
        if remote <= 0 or tuple(usable[pre.start + offset : pre.start + offset + remote]) != \
                pre.hashes[offset : offset + remote]:
            return TierPlan(lower)
        return TierPlan(lower, remote, None, pre.rows[offset : offset + remote])

    def close(self) -> None:
        """Finish what is written behind, then stop pulling: a pull in flight finishes on its
        own thread, its result unused."""
        if self._writer is not None:
            self._writer.close()
        if self._puller is not None:
            self._puller.shutdown(wait=False, cancel_futures=True)

    def serve_blocks(self, hashes: Sequence[bytes], dst: torch.Tensor) -> int:
        """BlockServer: leading blocks of `hashes` from this worker's device, then host/disk."""
        on_device = self.pool.get_computed_blocks(hashes)
        if on_device:
            dst[: len(on_device)] = self.read_blocks(on_device)
        return len(on_device) + self._read_lower(hashes[len(on_device) :], dst[len(on_device) :])

    # ------------------------------------------------------------ promotion

    def match(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of `hashes` held by the host or the disk tier."""
        if not hashes:
            return 0
        in_host = self.host.contains(hashes) if self.host is not None else [False] * len(hashes)
        in_disk = self.disk.contains(hashes) if self.disk is not None else [False] * len(hashes)
        for i, (h, d) in enumerate(zip(in_host, in_disk)):
            if not (h or d):
                return i
        return len(hashes)

    def pin(self, hashes: Sequence[bytes]) -> list[tuple[object, list[bytes]]]:
        """Pin these blocks wherever they are, so the allocation that makes room for them on the
        device (which demotes other blocks) cannot evict them. Returns what to `unpin`."""
        pinned = []
        for tier in (self.host, self.disk):
            if tier is not None and hashes:
                got = tier.pin(hashes)
                pinned.append((tier, [h for h, ok in zip(hashes, got) if ok]))
        return pinned

    @staticmethod
    def unpin(pinned: list[tuple[object, list[bytes]]]) -> None:
        for tier, hashes in pinned:
            if hashes:
                tier.unpin(hashes)  # type: ignore[attr-defined]

    def load(self, hashes: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Copy blocks from host (else disk) into device `block_ids`; returns how many leading
        blocks arrived intact (a corrupt or vanished block ends the run: the rest is recomputed)."""
        if not hashes:
            return 0
        buf = torch.empty(len(hashes), self.block_bytes, dtype=torch.uint8, device="cpu")
        n = self._read_lower(hashes, buf)
        if n:
            self.write_blocks(block_ids[:n], buf[:n])
        return n

    def load_plan(self, plan: TierPlan, hashes: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Fill `block_ids` per `plan` (host/disk first, then the remote holder); leading count."""
        n = self.load(hashes[: plan.lower], block_ids[: plan.lower])
        if n < plan.lower or not plan.remote:
            return n
        if plan.rows is not None:  # pulled already (fetch_async)
            buf, got = plan.rows, plan.remote
        elif self.remote is not None and plan.holder is not None:
            want = hashes[n : n + plan.remote]
            buf = torch.empty(len(want), self.block_bytes, dtype=torch.uint8, device="cpu")
            got = self.remote.fetch(plan.holder, want, buf)
        else:
            return n
        if got:
            self.write_blocks(block_ids[n : n + got], buf[:got])
            self.traffic.fetched_remote += got
        return n + got

    def _read_lower(self, hashes: Sequence[bytes], buf: torch.Tensor) -> int:
        """Leading blocks of `hashes` read intact from host, else disk, into `buf` rows."""
        if not hashes:
            return 0
        from_host = self.host.get(hashes, buf.numpy()) if self.host is not None else [False] * len(hashes)
        ok = list(from_host)
        missing = [i for i, hit in enumerate(ok) if not hit]
        if missing and self.disk is not None:
            rows = torch.empty(len(missing), self.block_bytes, dtype=torch.uint8, device="cpu")
            got = self.disk.get([hashes[i] for i in missing], rows.numpy())
            for row, i in enumerate(missing):
                if got[row]:
                    buf[i], ok[i] = rows[row], True
        n = self._leading(ok)
        self.traffic.promoted_from_host += sum(from_host[:n])
        self.traffic.promoted_from_disk += n - sum(from_host[:n])
        return n

    @staticmethod
    def _leading(flags: Sequence[bool]) -> int:
        for i, flag in enumerate(flags):
            if not flag:
                return i
        return len(flags)


def _gather(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """Blocks of one KV cache -> [n, its block bytes] uint8 host rows."""
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=kv_cache.device)
    blocks = kv_cache.index_select(2, idx).permute(2, 0, 1, 3, 4, 5).contiguous()
    return blocks.view(len(idx), -1).view(torch.uint8).to("cpu")


def _scatter(kv_cache: torch.Tensor, block_ids: Sequence[int], rows: torch.Tensor) -> None:
    """[n, its block bytes] uint8 rows (a column range of records: made contiguous) -> blocks."""
    layers, two, _, bs, kvh, hd = kv_cache.shape
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=kv_cache.device)
    typed = rows.contiguous().to(kv_cache.device).view(kv_cache.dtype).view(len(idx), layers, two, bs, kvh, hd)
    kv_cache.index_copy_(2, idx, typed.permute(1, 2, 0, 3, 4, 5))


def _runs(ops: list[object]) -> list[list]:
    """Consecutive ops of one kind: spills together, announcements of the same verb and tiers."""
    runs: list[list] = []
    for op in ops:
        last = runs[-1][-1] if runs else None
        same = (isinstance(op, _Spill) and isinstance(last, _Spill)) or (
            isinstance(op, _Announce) and isinstance(last, _Announce)
            and (op.verb, op.tiers) == (last.verb, last.tiers))
        if same:
            runs[-1].append(op)
        else:
            runs.append([op])
    return runs
