"""The shared-memory segment of a host arena: its layout, how it is opened, and its lock.

    | header 64 B | slot table: num_slots x SLOT_DTYPE | hash index: index_cap x int32 | pad |
    | slot data (4 KiB aligned): num_slots x slot_bytes                                        |

The header records magic, layout version, num_slots, slot_bytes, index_cap and the LRU clock
`tick`; offsets of the other regions follow from (num_slots, slot_bytes) alone (`ArenaLayout`),
so every process that attaches computes the same views. `kvpool.host_tier` gives them meaning.
"""

from __future__ import annotations

import fcntl
import os
import re
import sys
import tempfile
import threading
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from halfmoon.core.blocks import round_up
from halfmoon.kvpool.block_hash import HASH_BYTES
from halfmoon.kvpool.errors import TierLayoutError
from halfmoon.kvpool.tier_base import check_positive_ints, check_slot_bytes

MAGIC = 0x3130_4E52_4148_4D48  # b"HMHARN01" little-endian
VERSION = 1
HEADER_BYTES = 64
HEADER_DTYPE = np.dtype([("magic", "<u8"), ("version", "<u4"), ("num_slots", "<u4"),
                         ("slot_bytes", "<u8"), ("index_cap", "<u8"), ("tick", "<u8")])
SLOT_DTYPE = np.dtype([("hash", "u1", (HASH_BYTES,)), ("tick", "<u8"), ("checksum", "<u8"),
                       ("pins", "<i4"), ("pid", "<i4"), ("state", "u1")], align=True)


@dataclass(frozen=True, slots=True)
class ArenaLayout:
    """Byte offsets of the segment's regions, derived from (num_slots, slot_bytes)."""

    num_slots: int
    slot_bytes: int

    @property
    def index_cap(self) -> int:
        """Power of two >= 4 * num_slots: load factor <= 1/4, so probe runs (and the shifts of
        a deletion) are short, and an EMPTY entry always ends a probe. 16 B per slot."""
        return 1 << (4 * self.num_slots - 1).bit_length()

    @property
    def index_offset(self) -> int:
        return round_up(HEADER_BYTES + self.num_slots * SLOT_DTYPE.itemsize, 64)

    @property
    def data_offset(self) -> int:
        return round_up(self.index_offset + 4 * self.index_cap, 4096)

    @property
    def total_bytes(self) -> int:
        return self.data_offset + self.num_slots * self.slot_bytes


def check_geometry(num_slots: int, slot_bytes: int) -> None:
    check_positive_ints(num_slots=num_slots, slot_bytes=slot_bytes)
    check_slot_bytes(slot_bytes)
    if num_slots >= 2**31 - 1:
        raise ValueError(f"num_slots must be < 2^31 - 1, got {num_slots}")


def lock_path(name: str, lock_dir: str | None) -> str:
    """Lock file next to the segment (/dev/shm) so every process of the node finds it."""
    if lock_dir is None:
        lock_dir = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(lock_dir, f"{name}.halfmoon.lock")


def users_path(lock_file: str) -> str:
    """The file whose shared `flock`s count the handles attached to an arena (see `ArenaUsers`)."""
    return lock_file.removesuffix(".lock") + ".users"


class ArenaUsers:
    """Which handles are attached to a node's arena: each holds a shared `flock` on the users
    file for its lifetime (the kernel drops it when the process dies, however it dies), so a
    handle that can take the lock exclusively is the last one attached. Both calls run under
    the arena's `ArenaLock`, which orders attaches against the last handle's unlink."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_SH)

    def leave(self) -> bool:
        """Drop this handle's hold; True when no other handle (of any process) holds one."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(self._fd)


def open_shm(name: str, size: int = 0) -> SharedMemory:
    """Create (size > 0) or attach a segment whose lifetime `unlink()` owns explicitly.

    Before Python 3.13 every process that merely attaches registers the segment with its
    resource tracker, which unlinks it when that process exits, destroying the node's arena;
    so the registration is undone here, and `HostArena.unlink` re-registers before unlinking.
    """
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,200}", name):
        raise ValueError(f"arena name must match [A-Za-z0-9_.-]{{1,200}}, got {name!r}")
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, create=size > 0, size=size,
                            track=False)  # type: ignore[call-arg]
    shm = SharedMemory(name=name, create=size > 0, size=size)
    resource_tracker.unregister("/" + shm.name, "shared_memory")
    return shm


class ArenaLock:
    """Mutual exclusion over the slot table: a thread lock for this handle's threads plus an
    exclusive `flock` on a lock file for other handles and processes (flock alone does not
    exclude threads that share one open file description)."""

    def __init__(self, path: str, create: bool) -> None:
        """Open the lock file; only `create` makes it (an attach to a missing arena must not
        leave one behind: FileNotFoundError)."""
        self.path = path
        self._thread_lock = threading.Lock()
        self._fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)

    def __enter__(self) -> None:
        self._thread_lock.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._thread_lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._thread_lock.release()

    def close(self) -> None:
        os.close(self._fd)


def read_layout(shm: SharedMemory) -> ArenaLayout:
    """The layout recorded in an existing segment's header (closes `shm` if it is not one)."""
    try:
        header = np.ndarray((), HEADER_DTYPE, buffer=shm.buf).copy()
        if int(header["magic"]) != MAGIC or int(header["version"]) != VERSION:
            raise TierLayoutError(f"shared memory {shm.name!r} is not a v{VERSION} host arena")
        layout = ArenaLayout(int(header["num_slots"]), int(header["slot_bytes"]))
        if layout.index_cap != int(header["index_cap"]) or shm.size < layout.total_bytes:
            raise TierLayoutError(f"host arena {shm.name!r} header does not match its size")
    except BaseException:
        shm.close()
        raise
    return layout

