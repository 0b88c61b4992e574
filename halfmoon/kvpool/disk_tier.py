"""Disk (NVMe) tier: a slab file of fixed-size KV block slots, LRU, a bounded I/O thread pool.

Files under `directory`:

    slab.bin       capacity_slots x slot_bytes; slot s at offset s * slot_bytes
    manifest.bin   slot -> (hash, checksum), least recently used first (kvpool.disk_manifest),
                   written at `close()`, consumed (deleted) when the tier opens

The manifest exists only between a clean close and the next open, so a clean restart comes
back warm (same blocks, same LRU order) and a crash comes back cold: never a stale mapping.
The slab is only ever read through a per-slot checksum (kvpool.checksum) kept in memory and
in the manifest, so a torn or corrupted slot is a miss and is dropped, never served.

Bookkeeping lives in memory (one process owns a disk tier; the host arena is the tier that
processes share) under a thread lock; bytes move outside it with os.pwrite / os.preadv straight
between the caller's buffers and the file, in the I/O pool. A slot is FREE, WRITING (reserved by
one put, invisible to readers, not evictable) or READY; READY slots sit in an LRU order, and a
pinned (leased) one is never evicted. The verbs every tier shares are in kvpool.tier_base.

Faults: a write failing with ENOSPC / EDQUOT / EFBIG / EACCES / EPERM / EROFS / EIO, or a
directory that cannot be written at open, switches the tier to READ-ONLY with one warning:
later puts store nothing and count `stats.write_errors`, reads of what is held keep working.
A write fault is often passing (a full disk freed again): `RETRY_WRITES_S` after it, the next put
tries to write again (logged); failing again, the tier is read-only for twice as long (at most
`MAX_RETRY_S`). A directory unwritable at open stays read-only.
"""

from __future__ import annotations

import errno
import heapq
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from halfmoon.kvpool.checksum import BatchChecksum
from halfmoon.kvpool.disk_manifest import (
    MANIFEST_FILE,
    RECORD,
    GeometryMismatch,
    fsync_dir,
    read_manifest,
    write_manifest,
)
from halfmoon.kvpool.errors import TierClosedError
from halfmoon.kvpool.tier_base import (
    BlockRows,
    BlockSource,
    BlockTier,
    PutResult,
    ReadLease,
    SlotState,
    TierStats,
    check_positive_ints,
    check_slot_bytes,
)

logger = logging.getLogger(__name__)

SLAB_FILE = "slab.bin"
RETRY_WRITES_S = 5.0  # read-only after a write fault, until the next put this long after it
MAX_RETRY_S = 120.0

# Errors that mean "this disk cannot take writes now"; any other OSError is a bug and raises.
WRITE_FAULTS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM,
                          errno.EROFS, errno.EIO})
_FREE, _WRITING, _READY = int(SlotState.FREE), int(SlotState.WRITING), int(SlotState.READY)


@dataclass(slots=True)
class _Slot:
    """Bookkeeping of one slab slot (invariants in DiskTier.check_integrity)."""

    state: int = _FREE
    key: bytes = b""
    checksum: int = 0
    pins: int = 0


@dataclass(slots=True)
class _WritePlan:
    """Slots reserved by one put: `slots[i]` (WRITING under `keys[i]`) gets src row `rows[i]`."""

    keys: list[bytes] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    evicted: list[bytes] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class _WriteJob:
    """One put in flight: its plan and source rows, and what its I/O threads report back."""

    plan: _WritePlan
    keys: list[bytes]
    rows: BlockRows
    given: np.ndarray | None  # checksums supplied by the caller, else computed into `sums`
    sums: BatchChecksum
    ok: list[bool] = field(default_factory=list)  # ok[i]: plan block i is on disk
    pending: int = 0  # groups still writing (under the tier's lock)
    faults: list[OSError] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    future: Future[PutResult] = field(default_factory=Future)

    def __post_init__(self) -> None:
        self.ok = [False] * len(self.plan.slots)


class DiskTier(BlockTier):
    """LRU tier of KV blocks in a slab file; the verbs of `BlockTier`, plus `put_async`."""

    _log = logger

    def __init__(self, directory: str | os.PathLike[str], slot_bytes: int, capacity_slots: int,
                 io_threads: int = 2, retry_writes_s: float = RETRY_WRITES_S) -> None:
        """Open (or create) the tier in `directory`; a clean previous close comes back warm.
        `retry_writes_s`: read-only this long after a write fault, then writes are tried again."""
        check_positive_ints(slot_bytes=slot_bytes, capacity_slots=capacity_slots,
                            io_threads=io_threads)
        check_slot_bytes(slot_bytes)
        self.directory = Path(directory)
        self.slot_bytes, self.capacity = slot_bytes, capacity_slots
        self.stats = TierStats()
        self.read_only = False
        self._retry_at: float | None = None  # read-only after a write fault: writes again from then
        self._retry_first_s = self._retry_s = retry_writes_s
        self._lock = threading.Lock()
        self._slots = [_Slot() for _ in range(capacity_slots)]
        self._index: dict[bytes, int] = {}  # key -> slot, for WRITING and READY slots
        self._lru: OrderedDict[int, None] = OrderedDict()  # READY slots, least recent first
        self._free = list(range(capacity_slots))  # a heap: the lowest free slot is used first
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="halfmoon-disk-io")
        self._io_threads = io_threads
        self._closed = False
        self._fd: int | None = None
        self._opened_read_only = False
        self._open_slab()

    def __repr__(self) -> str:
        mode = "closed" if self._closed else "read-only" if self.read_only else "read-write"
        return (f"DiskTier({str(self.directory)!r}, slot_bytes={self.slot_bytes}, "
                f"capacity={self.capacity}, free={len(self._free)}, {mode})")

    # --- sizes ----------------------------------------------------------------------------

    def num_free(self) -> int:
        """Slots holding nothing."""
        with self._locked():
            return len(self._free)

    # --- put / get ------------------------------------------------------------------------

    def put(self, hashes: Sequence[bytes], src: BlockSource,
            checksums: Sequence[int] | np.ndarray | None = None) -> PutResult:
        """Write blocks `src[i]` under `hashes[i]` and wait; see `put_async`."""
        return self.put_async(hashes, src, checksums).result()

    def put_async(self, hashes: Sequence[bytes], src: BlockSource,
                  checksums: Sequence[int] | np.ndarray | None = None) -> Future[PutResult]:
        """Reserve slots now, write them in the I/O pool; the future gives the PutResult.

        `src` ([n, slot_bytes] uint8, or n byte views) must stay unchanged until the future is
        done. Blocks already here are only touched; room comes from FREE slots, then from the
        least recently used unpinned READY ones (dropped: disk is the last tier). Read-only:
        nothing is written, `stored` is False for every block not already here, and the
        blocks count as `stats.write_errors`. `checksums` as in HostArena.put.
        """
        keys, rows, given = self._put_args(hashes, src, checksums)
        with self._locked():  # submitting under the lock: close() cannot shut the pool between
            plan = self._reserve(keys)
            if not plan.slots:
                return _done(self._finish(plan, keys, []))
            job = _WriteJob(plan, keys, rows, given,
                            BatchChecksum(len(plan.slots), self.slot_bytes))
            groups = _split(len(plan.slots), self._io_threads)
            job.pending = len(groups)
            for group in groups:  # the I/O threads write disjoint slices of the batch at once
                self._pool.submit(self._write_group, job, group)
        return job.future

    def lru_order(self) -> list[bytes]:
        """Hashes of the READY blocks, least recently used first (for tests and debugging)."""
        with self._locked():
            return [self._slots[slot].key for slot in self._lru]

    # --- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Finish pending writes, record the manifest (a clean restart comes back warm) and
        release the file. Failing to record the manifest is a warning: the next open is cold."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # no verb starts from here on; running writes finish below
        self._pool.shutdown(wait=True)
        with self._lock:
            if self._fd is None:
                return
            try:
                if not self._opened_read_only:  # else the old manifest is still on disk
                    self._write_manifest()
            except OSError as err:
                logger.warning("disk tier %s: could not record its manifest (%s); the next "
                               "open starts cold", self.directory, err)
            finally:
                os.close(self._fd)
                self._fd = None

    # --- internals: opening, manifest -----------------------------------------------------

    def _open_slab(self) -> None:
        """Open or create the slab read-write; an unwritable directory opens it read-only."""
        path = self.directory / SLAB_FILE
        size = self.capacity * self.slot_bytes
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            if os.fstat(self._fd).st_size != size:
                os.ftruncate(self._fd, size)  # sparse; a different geometry starts cold
        except OSError as err:
            if err.errno not in WRITE_FAULTS:
                raise
            self._open_read_only(path, err)
        self._load_manifest(consume=not self._opened_read_only)

    def _open_read_only(self, path: Path, err: OSError) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._opened_read_only = True
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError:
            self._fd = None  # nothing readable either: an empty read-only tier
        self._go_read_only(err)

    def _load_manifest(self, consume: bool) -> None:
        """Re-register the blocks a clean close recorded, in LRU order; then delete the
        manifest (`consume`), so that after a crash from here on the next open is cold."""
        path = self.directory / MANIFEST_FILE
        try:
            records = read_manifest(path, self.slot_bytes, self.capacity)
        except FileNotFoundError:
            return
        except GeometryMismatch:
            logger.warning("disk tier %s: manifest is for another geometry; starting cold",
                           self.directory)
            records = None
        except (OSError, ValueError) as err:
            logger.warning("disk tier %s: ignoring its manifest (%s); starting cold",
                           self.directory, err)
            records = None
        if records is not None and self._fd is not None:
            self._register(records)
        if consume:
            try:
                path.unlink()
                fsync_dir(self.directory)
            except OSError as err:
                logger.warning("disk tier %s: could not consume its manifest (%s)",
                               self.directory, err)

    def _register(self, records: np.ndarray) -> None:
        """Mark the recorded slots READY, oldest first (records are in LRU order)."""
        for record in records:  # validated by read_manifest: distinct slots and hashes
            slot, key = int(record["slot"]), record["hash"].tobytes()
            self._slots[slot] = _Slot(_READY, key, int(record["checksum"]))
            self._index[key] = slot
            self._lru[slot] = None
        taken = set(self._lru)
        self._free = [slot for slot in range(self.capacity) if slot not in taken]
        heapq.heapify(self._free)

    def _write_manifest(self) -> None:
        """Atomically record the READY slots, least recently used first (under the lock)."""
        assert self._fd is not None
        os.fsync(self._fd)  # the slab's bytes are durable before anything points at them
        records = np.zeros(len(self._lru), RECORD)
        for i, slot in enumerate(self._lru):
            info = self._slots[slot]
            records[i]["hash"] = np.frombuffer(info.key, np.uint8)
            records[i]["slot"], records[i]["checksum"] = slot, info.checksum
        write_manifest(self.directory / MANIFEST_FILE, self.slot_bytes, self.capacity, records)

    # --- internals: put (bookkeeping under the lock, bytes in the I/O pool) ---------------

    def _reserve(self, keys: list[bytes]) -> _WritePlan:
        """Claim a slot per new key (FREE first, then LRU victims) as WRITING."""
        plan = _WritePlan()
        wanted: dict[bytes, int] = {}  # new key -> its first row (dict keeps row order)
        for row, key in enumerate(keys):
            if key not in self._index and key not in wanted:
                wanted[key] = row
        if self.read_only and self._retry_at is not None and time.monotonic() >= self._retry_at:
            self.read_only, self._retry_at = False, None
            logger.info("disk tier %s: trying writes again %.0f s after the write fault", self.directory,
                        self._retry_s)
        if self.read_only:
            self.stats.write_errors += len(wanted)
            return plan
        for (key, row), slot in zip(wanted.items(), self._claim(plan, len(wanted), keys)):
            self._slots[slot] = _Slot(_WRITING, key)
            self._index[key] = slot
            plan.keys.append(key)
            plan.rows.append(row)
            plan.slots.append(slot)
        return plan

    def _claim(self, plan: _WritePlan, count: int, keep: list[bytes]) -> list[int]:
        """Up to `count` slots, ascending: FREE ones, then unpinned READY ones least recently
        used first (evicted into `plan.evicted`), never one holding a key of the current put."""
        taken = [heapq.heappop(self._free) for _ in range(min(count, len(self._free)))]
        protected = {self._index[key] for key in keep if key in self._index}
        for slot in list(self._lru):
            if len(taken) == count:
                break
            if self._slots[slot].pins == 0 and slot not in protected:
                plan.evicted.append(self._slots[slot].key)
                self._free_slot(slot, free=False)
                self.stats.evictions += 1
                taken.append(slot)
        return sorted(taken)

    def _write_group(self, job: _WriteJob, group: range) -> None:
        """I/O pool: write the plan's blocks `group`; the last group to end settles the put."""
        fault: OSError | None = None
        error: BaseException | None = None
        try:
            fault = self._write_rows(job, group)
        except BaseException as err:  # not a disk fault: a bug, reported through the future
            error = err
        with self._lock:
            if fault is not None:
                job.faults.append(fault)
            if error is not None:
                job.errors.append(error)
            job.pending -= 1
            if job.pending:
                return
            outcome = self._settle(job)
        # Outside the lock: the future's callbacks may call back into the tier.
        if isinstance(outcome, PutResult):
            job.future.set_result(outcome)
        else:
            job.future.set_exception(outcome)

    def _settle(self, job: _WriteJob) -> PutResult | BaseException:
        """The put's outcome once all its groups ended (under the lock); never raises, so the
        future is always resolved."""
        if job.errors:
            self._release_writes(job.plan, [False] * len(job.plan.slots))
            return job.errors[0]
        try:
            return self._complete(job)
        except BaseException as err:  # a bug: surface it to the caller, never hang it
            return err

    def _write_rows(self, job: _WriteJob, group: range) -> OSError | None:
        """pwrite blocks `group` of the plan, checksumming each; the fault that stopped it."""
        assert self._fd is not None, "a writable tier has its slab open"
        plan, rows = job.plan, job.rows
        for i in group:
            row = rows[plan.rows[i]]
            if job.given is None:
                job.sums.add(i, row)  # reads the block into cache; pwrite then copies from there
            try:
                _pwrite_all(self._fd, row, plan.slots[i] * self.slot_bytes)
            except OSError as err:
                if err.errno not in WRITE_FAULTS:
                    raise
                return err
            job.ok[i] = True
        return None

    def _complete(self, job: _WriteJob) -> PutResult:
        """Publish the blocks written, drop the rest; a write fault makes the tier read-only."""
        plan = job.plan
        sums = job.given[plan.rows] if job.given is not None else job.sums.result()
        for slot, checksum in zip(plan.slots, sums.tolist()):
            self._slots[slot].checksum = checksum
        if job.faults:
            self.stats.write_errors += job.ok.count(False)
            self._go_read_only(job.faults[0])
        else:
            self._retry_s = self._retry_first_s  # writing works: the next fault waits the shortest again
        return self._finish(plan, job.keys, job.ok)

    def _finish(self, plan: _WritePlan, keys: list[bytes], ok: list[bool]) -> PutResult:
        """Publish the reserved slots written (`ok`), free the rest, touch the put's blocks
        tail-first; the PutResult (under the lock)."""
        self._release_writes(plan, ok)
        unique = list(dict.fromkeys(keys))
        self._touch([self._index[key] for key in reversed(unique)
                     if key in self._index and self._slots[self._index[key]].state == _READY])
        return PutResult([key in self._index for key in keys], plan.evicted)

    def _release_writes(self, plan: _WritePlan, ok: list[bool]) -> None:
        for slot, written in zip(plan.slots, ok, strict=True):
            if written:
                self._slots[slot].state = _READY
                self._lru[slot] = None
                self.stats.stored += 1
            else:
                self._free_slot(slot)

    # --- internals: get -------------------------------------------------------------------

    def _read_leased(self, leases: list[ReadLease], out: BlockRows) -> list[bool]:
        """preadv each leased slot into its row and verify it (from cache), split over the
        I/O threads; False for a checksum mismatch, a short read or a read error."""
        sums = BatchChecksum(len(leases), self.slot_bytes)
        ok = [False] * len(leases)
        groups = _split(len(leases), self._io_threads)
        jobs = [self._pool.submit(self._read_rows, leases, out, sums, ok, g) for g in groups[1:]]
        try:
            if groups:
                self._read_rows(leases, out, sums, ok, groups[0])  # the caller's thread: one
        finally:
            wait(jobs)  # no pool thread may still write into `out` once the leases are returned
        for job in jobs:
            job.result()
        got = sums.result().tolist()
        return [read and g == lease.checksum for read, g, lease in zip(ok, got, leases)]

    def _read_rows(self, leases: list[ReadLease], out: BlockRows, sums: BatchChecksum,
                   ok: list[bool], group: range) -> None:
        """Read leases[i] for i in `group`; ok[i] says the read returned the whole block."""
        assert self._fd is not None, "a tier holding blocks has its slab open"
        for i in group:
            row, slot = leases[i].row, leases[i].slot
            try:
                got = os.preadv(self._fd, [memoryview(out[row])], slot * self.slot_bytes)
            except OSError as err:
                logger.warning("disk tier %s: reading slot %d failed: %s", self.directory,
                               slot, err)
                continue
            if got == self.slot_bytes:
                sums.add(i, out[row])
                ok[i] = True

    # --- internals: slots -----------------------------------------------------------------

    @property
    def _label(self) -> str:
        return f"disk tier {str(self.directory)!r}"

    def _slot_of(self, key: bytes) -> int | None:
        return self._index.get(key)

    def _is_ready(self, slot: int) -> bool:
        return self._slots[slot].state == _READY

    def _pins_at(self, slot: int) -> int:
        return self._slots[slot].pins

    def _add_pins(self, slot: int, count: int) -> None:
        self._slots[slot].pins += count

    def _checksum_at(self, slot: int) -> int:
        return self._slots[slot].checksum

    def _touch(self, slots: list[int]) -> None:
        """Mark `slots` used now, in order: the last one is the most recently used."""
        for slot in slots:
            self._lru.move_to_end(slot)

    def _free_slot(self, slot: int, free: bool = True) -> None:
        """Forget a WRITING or READY slot; back to the free heap unless being reused."""
        info = self._slots[slot]
        del self._index[info.key]
        self._lru.pop(slot, None)
        self._slots[slot] = _Slot()
        if free:
            heapq.heappush(self._free, slot)

    def _go_read_only(self, err: OSError) -> None:
        if self.read_only:
            return
        self.read_only = True
        if self._opened_read_only:
            logger.warning("disk tier %s: %s; the tier is READ-ONLY from now on (blocks it "
                           "holds stay readable, new writes are dropped)", self.directory, err)
            return
        self._retry_at = time.monotonic() + self._retry_s
        logger.warning("disk tier %s: %s; the tier is READ-ONLY for %.0f s (blocks it holds stay "
                       "readable, new writes are dropped), then tries writes again", self.directory, err,
                       self._retry_s)
        self._retry_s = min(self._retry_s * 2, MAX_RETRY_S)

    def _locked(self) -> AbstractContextManager[object]:
        if self._closed:
            raise TierClosedError(f"{self._label} is closed")
        return self._lock

    def _release_lock(self) -> AbstractContextManager[object]:
        # The bookkeeping lives in memory: a get racing close() still returns its leases.
        return self._lock

    def _integrity_summary(self) -> str:
        return (f"free {len(self._free)}, indexed {len(self._index)}, lru {len(self._lru)}, "
                f"capacity {self.capacity}")

    def _integrity_problem(self) -> str | None:
        states = Counter(info.state for info in self._slots)
        if len(self._free) != states[_FREE] or len(set(self._free)) != len(self._free):
            return "free heap does not match the FREE slots (or lists one twice)"
        if any(self._slots[slot].state != _FREE for slot in self._free):
            return "free heap holds a used slot"
        if len(self._index) != self.capacity - states[_FREE]:
            return f"index holds {len(self._index)} keys for {self.capacity - states[_FREE]} slots"
        if any(self._slots[slot].key != key for key, slot in self._index.items()):
            return "an index entry points at a slot holding another key"
        if set(self._lru) != {s for s, info in enumerate(self._slots) if info.state == _READY}:
            return "LRU order does not hold exactly the READY slots"
        if any(info.pins < 0 or (info.pins and info.state != _READY) for info in self._slots):
            return "negative pins, or pins on a slot that is not READY"
        return None


def _pwrite_all(fd: int, row: np.ndarray, offset: int) -> None:
    """One block at `offset`. A short write to a regular file means the disk filled up."""
    done = os.pwrite(fd, memoryview(row), offset)
    if done != row.nbytes:
        raise OSError(errno.ENOSPC, f"short write ({done} of {row.nbytes} bytes)")


def _split(n: int, parts: int) -> list[range]:
    """0..n-1 as up to `parts` contiguous non-empty ranges of near-equal length."""
    parts = min(parts, n)
    bounds = [n * k // parts for k in range(parts + 1)] if parts else []
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _done(result: PutResult) -> Future[PutResult]:
    future: Future[PutResult] = Future()
    future.set_result(result)
    return future
