"""The disk tier's manifest: which slab slot holds which block, recorded at a clean close.

    manifest.bin   | header | records: (hash, slot, checksum), least recently used first |

Written atomically (temp file + fsync + rename + fsync of the directory) and consumed (deleted)
when the tier opens, so it exists only between a clean close and the next open: a clean restart
comes back warm and a crash comes back cold, never with a stale mapping.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np

from halfmoon.kvpool.block_hash import HASH_BYTES

MANIFEST_FILE = "manifest.bin"
_MAGIC = b"HMDISK01"
_VERSION = 1
_HEADER = np.dtype([("magic", "S8"), ("version", "<u4"), ("crc", "<u4"),
                    ("slot_bytes", "<u8"), ("capacity", "<u8"), ("count", "<u8")])
RECORD = np.dtype([("hash", "u1", (HASH_BYTES,)), ("slot", "<u8"), ("checksum", "<u8")])


class GeometryMismatch(ValueError):
    """The manifest was written for another slot size or capacity (not damage: start cold)."""


def read_manifest(path: Path, slot_bytes: int, capacity: int) -> np.ndarray:
    """The manifest's RECORD array, validated: distinct slots in range and distinct hashes.

    Raises FileNotFoundError when there is none, GeometryMismatch when it is for another
    geometry, ValueError when it is torn or corrupt.
    """
    data = path.read_bytes()
    if len(data) < _HEADER.itemsize:
        raise ValueError("manifest is truncated")
    header = np.frombuffer(data, _HEADER, count=1)[0]
    if header["magic"] != _MAGIC or int(header["version"]) != _VERSION:
        raise ValueError("not a v1 disk tier manifest")
    if (int(header["slot_bytes"]), int(header["capacity"])) != (slot_bytes, capacity):
        raise GeometryMismatch("manifest is for another geometry")
    body = data[_HEADER.itemsize:]
    count = int(header["count"])
    if len(body) != count * RECORD.itemsize or zlib.crc32(body) != int(header["crc"]):
        raise ValueError("manifest is torn or corrupt (length or crc mismatch)")
    records = np.frombuffer(body, RECORD, count=count)
    slots, keys = records["slot"], {r.tobytes() for r in records["hash"]}
    if (slots >= capacity).any() or len(np.unique(slots)) != count or len(keys) != count:
        raise ValueError("manifest lists a slot or a hash twice, or a slot out of range")
    return records


def write_manifest(path: Path, slot_bytes: int, capacity: int, records: np.ndarray) -> None:
    """Atomically record `records` (a RECORD array, least recently used first)."""
    body = records.tobytes()
    header = np.zeros((), _HEADER)
    header["magic"], header["version"], header["crc"] = _MAGIC, _VERSION, zlib.crc32(body)
    header["slot_bytes"], header["capacity"], header["count"] = (slot_bytes, capacity,
                                                                 len(records))
    _atomic_write(path, header.tobytes() + body)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so a reader sees the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
