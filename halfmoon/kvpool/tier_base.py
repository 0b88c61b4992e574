"""What the host arena and the disk tier share: fixed-size block slots keyed by block hash.

A tier holds whole KV blocks, one per slot of `slot_bytes`, under their 16-byte chained hash
(kvpool.block_hash). A slot is FREE, WRITING (reserved by one put, invisible to readers, not
evictable) or READY (served); a READY slot carries a pin count (pins and read leases) and the
checksum (kvpool.checksum) taken when it was stored. `BlockTier` writes the verbs that read the
same on every tier once: lookups, pins, the leased get, the integrity check. A tier supplies its
storage (shared-memory table or in-memory bookkeeping) through a few slot primitives.

A get leases (pins) READY slots under the lock, reads them outside it and verifies each checksum,
then returns the leases: no reader sees a half-written block and nothing leased is evicted.
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Self

import numpy as np
import torch

from halfmoon.kvpool.block_hash import check_hashes
from halfmoon.kvpool.errors import HashStateError, PoolIntegrityError

# A 2-D [n, block_bytes] uint8 array, or n 1-D uint8 arrays (views of single blocks).
BlockRows = np.ndarray | list[np.ndarray]
BlockSource = torch.Tensor | np.ndarray | Sequence[np.ndarray | memoryview | bytes | bytearray]


class SlotState(enum.IntEnum):
    """Life of a slot: FREE -> WRITING (reserved by one writer) -> READY (served) -> FREE."""

    FREE = 0
    WRITING = 1
    READY = 2


class PutResult(NamedTuple):
    """`stored[i]`: block i is in the tier after the put (written now, already there, or being
    written by another process). `evicted`: hashes evicted to make room, oldest first."""

    stored: list[bool]
    evicted: list[bytes]


class EvictedBlocks(NamedTuple):
    """Blocks leaving a tier, handed to `on_evict` for demotion. `blocks` are views of the slots,
    valid only during the callback; `checksums` are the ones computed when they were stored, so
    a block corrupted while resident stays detectably corrupt after demotion."""

    hashes: list[bytes]
    blocks: list[np.ndarray]
    checksums: np.ndarray


EvictCallback = Callable[[EvictedBlocks], object]


@dataclass(slots=True)
class TierStats:
    """Counters of one tier handle (this process's calls only)."""

    hits: int = 0
    misses: int = 0
    stored: int = 0
    evictions: int = 0
    corrupt_drops: int = 0
    write_errors: int = 0


class ReadLease(NamedTuple):
    """A get's hold on one READY slot: dst row, slot, checksum stored with the block."""

    row: int
    slot: int
    checksum: int


def as_block_rows(blocks: BlockSource, n: int, block_bytes: int,
                  writable: bool = False) -> BlockRows:
    """Zero-copy numpy view of `n` blocks: a [n, block_bytes] uint8 CPU tensor or array (rows
    contiguous), or a sequence of n byte buffers. Raises ValueError/TypeError on a mismatch."""
    if isinstance(blocks, torch.Tensor):
        if blocks.device.type != "cpu":
            raise ValueError(f"blocks must be a CPU tensor (stage device blocks through "
                             f"host memory), got {blocks.device}")
        blocks = blocks.detach().numpy()
    if isinstance(blocks, np.ndarray):
        ok = blocks.dtype == np.uint8 and blocks.shape == (n, block_bytes)
        if not ok or (n and blocks.strides[1] != 1):
            raise ValueError(f"expected a [{n}, {block_bytes}] uint8 array with contiguous rows, "
                             f"got {blocks.shape} {blocks.dtype} strides {blocks.strides}")
        if writable and not blocks.flags.writeable:
            raise ValueError("destination array is read-only")
        return blocks
    rows = [b if isinstance(b, np.ndarray) else np.frombuffer(b, dtype=np.uint8) for b in blocks]
    if len(rows) != n or any(r.dtype != np.uint8 or r.shape != (block_bytes,) for r in rows):
        raise ValueError(f"expected {n} blocks of {block_bytes} uint8 bytes each")
    if writable and not all(r.flags.writeable for r in rows):
        raise ValueError("a destination buffer is read-only")
    return rows


def check_checksums(checksums: Sequence[int] | np.ndarray | None, n: int) -> np.ndarray | None:
    """Validate caller-supplied block checksums: None, or n integers in [0, 2^64)."""
    if checksums is None:
        return None
    problem = f"checksums must be {n} integers in [0, 2^64)"
    if isinstance(checksums, np.ndarray):
        if checksums.dtype.kind not in "iu" or (checksums < 0).any():
            raise ValueError(f"{problem}, got dtype {checksums.dtype}")
    elif not all(isinstance(v, int) and not isinstance(v, bool) for v in checksums):
        raise ValueError(f"{problem}, got {list(checksums)!r}")
    try:
        values = np.array(checksums, dtype=np.uint64)
    except OverflowError:
        raise ValueError(f"{problem}, got {list(checksums)!r}") from None
    if values.shape != (n,):
        raise ValueError(f"{problem}, got shape {values.shape}")
    return values


def check_positive_ints(**values: int) -> None:
    """Raise ValueError unless every value is a positive int (not a bool)."""
    for label, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{label} must be a positive int, got {value!r}")


def check_slot_bytes(slot_bytes: int) -> None:
    """Checksums sum 64-bit words, so a slot is a whole number of them."""
    if slot_bytes % 8:
        raise ValueError(f"slot_bytes must be a multiple of 8 (checksums sum 64-bit words), "
                         f"got {slot_bytes}")


class BlockTier(ABC):
    """The verbs every block tier answers the same way; a tier supplies the slot primitives.

    Every verb validates its arguments before touching the tier: when it raises, nothing
    changed. Within one put or get, blocks are touched tail-first, so a request's last block is
    evicted before its first (the prefix other requests are likeliest to share).
    """

    capacity: int  # number of slots
    slot_bytes: int  # bytes per block
    stats: TierStats
    _log: ClassVar[logging.Logger]  # the tier module's logger

    # --- what a tier provides -------------------------------------------------------------

    @property
    @abstractmethod
    def _label(self) -> str:
        """How messages name this tier, e.g. "host arena 'hm-node0'"."""

    @abstractmethod
    def num_free(self) -> int:
        """Slots holding nothing."""

    @abstractmethod
    def put(self, hashes: Sequence[bytes], src: BlockSource,
            checksums: Sequence[int] | np.ndarray | None = None) -> PutResult:
        """Store blocks `src[i]` under `hashes[i]`."""

    @abstractmethod
    def lru_order(self) -> list[bytes]:
        """Hashes of the READY blocks, least recently used first (for tests and debugging)."""

    @abstractmethod
    def close(self) -> None:
        """Release this handle."""

    @abstractmethod
    def _locked(self) -> AbstractContextManager[object]:
        """The bookkeeping lock; raises TierClosedError on a closed handle."""

    @abstractmethod
    def _slot_of(self, key: bytes) -> int | None:
        """Slot indexed under `key` (WRITING or READY), if any (under the lock)."""

    @abstractmethod
    def _is_ready(self, slot: int) -> bool:
        """Whether `slot` is READY (under the lock)."""

    @abstractmethod
    def _pins_at(self, slot: int) -> int: ...

    @abstractmethod
    def _add_pins(self, slot: int, count: int) -> None: ...

    @abstractmethod
    def _checksum_at(self, slot: int) -> int: ...

    @abstractmethod
    def _touch(self, slots: list[int]) -> None:
        """Mark `slots` used now, in order: the last one is the most recently used."""

    @abstractmethod
    def _free_slot(self, slot: int) -> None:
        """Forget a WRITING or READY slot and make it FREE (under the lock)."""

    @abstractmethod
    def _read_leased(self, leases: list[ReadLease], out: BlockRows) -> list[bool]:
        """Copy each leased slot into its row of `out`; True where its checksum matched."""

    @abstractmethod
    def _integrity_problem(self) -> str | None:
        """What is inconsistent in the bookkeeping, or None (under the lock)."""

    @abstractmethod
    def _integrity_summary(self) -> str:
        """Counts that help read an integrity failure (under the lock)."""

    # --- shared verbs ---------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def num_used(self) -> int:
        """Slots READY or being written."""
        return self.capacity - self.num_free()

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        """Whether each block is READY here."""
        keys = check_hashes(hashes)
        with self._locked():
            return [self._ready_slot(key) is not None for key in keys]

    def match_prefix(self, hashes: Sequence[bytes]) -> int:
        """Number of leading blocks READY here."""
        keys = check_hashes(hashes)
        with self._locked():
            for i, key in enumerate(keys):
                if self._ready_slot(key) is None:
                    return i
            return len(keys)

    def get(self, hashes: Sequence[bytes], dst: BlockSource) -> list[bool]:
        """Copy each READY block into `dst[i]` ([n, slot_bytes] uint8, writable); return hits.

        A block whose bytes fail their checksum (or cannot be read) is a miss, never returned,
        and is dropped with a warning once no one else holds it. Rows of misses in `dst` are
        left as they were, or hold the rejected bytes of a corrupt block.
        """
        keys = check_hashes(hashes)
        out = as_block_rows(dst, len(keys), self.slot_bytes, writable=True)
        with self._locked():
            leases = self._lease(keys)
        good: list[bool] | None = None
        try:
            good = self._read_leased(leases, out)
        finally:
            with self._release_lock():
                self._release_reads(leases, good, len(keys))
        hits = [False] * len(keys)
        for lease, ok in zip(leases, good or ()):
            hits[lease.row] = ok
        return hits

    def pin(self, hashes: Sequence[bytes]) -> list[bool]:
        """Pin (lease) each READY block so it cannot be evicted; return which were pinned.
        Every True must be matched by one `unpin`."""
        keys = check_hashes(hashes)
        with self._locked():
            slots = [self._ready_slot(key) for key in keys]
            for slot in slots:
                if slot is not None:
                    self._add_pins(slot, 1)
        return [slot is not None for slot in slots]

    def unpin(self, hashes: Sequence[bytes]) -> None:
        """Drop one pin per listed block. A block not pinned that many times raises
        HashStateError and nothing is unpinned."""
        keys = check_hashes(hashes)
        with self._locked():
            for key, times in Counter(keys).items():
                slot = self._ready_slot(key)
                pins = 0 if slot is None else self._pins_at(slot)
                if times > pins:
                    raise HashStateError(key, f"unpinned {times} times but holds {pins} pins")
            for slot in [self._ready_slot(key) for key in keys]:
                assert slot is not None, "validated above"
                self._add_pins(slot, -1)

    def pins(self, hash_: bytes) -> int:
        """Pins (and read leases) held on a block; 0 when absent."""
        (key,) = check_hashes([hash_])
        with self._locked():
            slot = self._slot_of(key)
            return 0 if slot is None else self._pins_at(slot)

    def check_integrity(self) -> None:
        """Raise PoolIntegrityError unless the bookkeeping is consistent.

        O(capacity); for tests and debugging, not the hot path.
        """
        with self._locked():
            problem = self._integrity_problem()
            if problem is None:
                return
            summary = self._integrity_summary()
        raise PoolIntegrityError(f"{self._label}: {problem} [{summary}]")

    # --- shared internals -----------------------------------------------------------------

    def _ready_slot(self, key: bytes) -> int | None:
        slot = self._slot_of(key)
        return slot if slot is not None and self._is_ready(slot) else None

    def _release_lock(self) -> AbstractContextManager[object]:
        """The lock a get's leases are returned under (a tier may allow it after close)."""
        return self._locked()

    def _lease(self, keys: list[bytes]) -> list[ReadLease]:
        leases = []
        for row, key in enumerate(keys):
            slot = self._ready_slot(key)
            if slot is not None:
                self._add_pins(slot, 1)  # a lease: the slot cannot be evicted or rewritten
                leases.append(ReadLease(row, slot, self._checksum_at(slot)))
        return leases

    def _release_reads(self, leases: list[ReadLease], good: list[bool] | None,
                       asked: int) -> None:
        """Return the leases; touch good blocks tail-first; drop bad ones nobody else holds.
        `good` is None when the read itself failed: then nothing is touched or dropped."""
        for lease in leases:
            self._add_pins(lease.slot, -1)
        if good is None:
            return
        self.stats.hits += sum(good)
        self.stats.misses += asked - sum(good)
        self._touch([lease.slot for lease, ok in reversed(list(zip(leases, good))) if ok])
        bad = {lease.slot for lease, ok in zip(leases, good) if not ok}
        dropped = [s for s in sorted(bad) if self._pins_at(s) == 0 and self._is_ready(s)]
        for slot in dropped:
            self._free_slot(slot)
        if bad:
            self.stats.corrupt_drops += len(dropped)
            self._log.warning("%s: %d block(s) failed their checksum or could not be read; "
                              "served as misses, %d dropped (the rest are pinned elsewhere)",
                              self._label, len(bad), len(dropped))

    def _put_args(self, hashes: Sequence[bytes], src: BlockSource,
                  checksums: Sequence[int] | np.ndarray | None,
                  ) -> tuple[list[bytes], BlockRows, np.ndarray | None]:
        """A put's arguments validated: keys, source rows, caller checksums (or None)."""
        keys = check_hashes(hashes)
        return (keys, as_block_rows(src, len(keys), self.slot_bytes),
                check_checksums(checksums, len(keys)))
