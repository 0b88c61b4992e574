"""A GGUF file's header, parsed fast: the metadata key/values and the tensor infos, without the
tensor data.

`gguf.GGUFReader` builds a numpy memmap view per metadata part; for a tokenizer's ~100k
vocabulary and merge strings that takes ~8 s here, the largest part of a worker's (re)start once
the dequantized weights come from the weights cache. This reads the same header with `struct` over
one `bytes` of it (~0.1 s). Values are what `GGUFReader`'s `field.contents()` gives: str, int,
float, bool, or lists of them (tests/engine/test_gguf_header.py compares the two on a real file).
The tensors' bytes are still read by `GGUFReader` when the weights cache misses.

GGUF v2/v3 layout (little-endian): magic "GGUF", u32 version, u64 tensor count, u64 key/value
count; each key/value: string key, u32 type, value; each tensor info: string name, u32 n_dims,
u64 dims[n_dims], u32 ggml type, u64 offset. A string is u64 length + UTF-8 bytes; an array is u32
element type + u64 count + elements. The tensor data starts at the end of the header rounded up to
`general.alignment` (default 32); a tensor's offset counts from there.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from halfmoon.engine.errors import ModelLoadError

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


class Field(NamedTuple):
    """One metadata value; `contents()` as gguf's ReaderField has it."""

    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # as GGUF lists it: the input dimension first
    ggml_type: int
    offset: int


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    version: int
    fields: dict[str, Field]
    tensors: list[TensorInfo]
    data_offset: int = 0  # where the tensor data starts in the file


class _Cursor:
    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = bytes(self.buf[self.pos:self.pos + n])
        if len(raw) != n:
            raise ValueError(f"string of {n} bytes runs past the end of the file")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.unpack(fmt)

    def array(self) -> list[Any]:
        kind, count = self.unpack("<I"), self.unpack("<Q")
        if kind == _STRING:
            return [self.string() for _ in range(count)]
        if kind == _ARRAY:
            return [self.array() for _ in range(count)]
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise ValueError(f"unknown GGUF array element type {kind}")
        size = struct.calcsize(fmt)
        values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos))
        self.pos += size * count
        return values


def read_header(path: str | Path) -> GGUFHeader:
    """The metadata and tensor infos of the GGUF file at `path`; a file that is not GGUF, or is
    truncated or corrupt, is a ModelLoadError naming it."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != MAGIC:
            raise ModelLoadError(f"{path}: not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, path)
    except (OSError, ValueError, struct.error) as e:
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF header ({type(e).__name__}: {e})") from e


def _parse(buf: Any, path: Path) -> GGUFHeader:
    c = _Cursor(buf)
    c.pos = 4
    version, n_tensors, n_kv = c.unpack("<I"), c.unpack("<Q"), c.unpack("<Q")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    fields = {}
    for _ in range(n_kv):
        key = c.string()
        fields[key] = Field(c.value(c.unpack("<I")))
    tensors = []
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.unpack("<Q") for _ in range(c.unpack("<I")))
        tensors.append(TensorInfo(name, dims, c.unpack("<I"), c.unpack("<Q")))
    align = int(fields["general.alignment"].value) if "general.alignment" in fields else DEFAULT_ALIGNMENT
    return GGUFHeader(version, fields, tensors, -(-c.pos // align) * align)
