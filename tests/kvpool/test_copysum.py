"""The fused copy + checksum kernel (kvpool/_copysum.c) against numpy's block_checksums.

Every path of the kernel is driven: AVX2 / SSE2 streaming stores (aligned destination, chunks
of whole cache lines), the plain path (misaligned destination, odd chunk sizes), and the numpy
fallback `BatchChecksum.copy_add` uses when the kernel is not built.
"""

from __future__ import annotations

import platform
from typing import Any

import numpy as np
import pytest

from halfmoon.kvpool import checksum as checksum_mod
from halfmoon.kvpool.checksum import NATIVE_KERNEL, BatchChecksum, block_checksums



@pytest.fixture
def native() -> Any:
    """The kernel. gcc and the Python headers are on every machine of this project (dev, CI):
    a missing kernel means the install broke and the tiers run at half speed, so it fails."""
    assert NATIVE_KERNEL, "halfmoon.kvpool._copysum was not built by `pip install -e .`"
    return checksum_mod._copysum


def _aligned(nbytes: int, align: int, offset: int = 0) -> np.ndarray:
    """A writable uint8 array of nbytes starting `offset` bytes past an `align` boundary."""
    raw = np.zeros(nbytes + align + offset, np.uint8)
    start = (-raw.ctypes.data) % align + offset
    return raw[start : start + nbytes]


@pytest.mark.parametrize(("nbytes", "offset", "path"), [
    (3 * 4096, 0, {"avx2", "sse2"}),   # whole 4 KiB chunks, 32 B aligned: streaming stores
    (737_280, 16, {"sse2"}),           # SmolLM2's block, 16 B aligned only: SSE2
    (737_280, 8, {"plain"}),           # 8 B aligned: plain stores
    (72, 0, {"plain"}),                # 9-word chunks (not a cache line): plain
    (8, 3, {"plain"}),                 # one word at an odd address
])
def test_copy_sum_copies_and_sums_like_numpy(native: Any, nbytes: int, offset: int,
                                             path: set[str]) -> None:
    rng = np.random.default_rng(nbytes + offset)
    src = rng.integers(0, 256, nbytes, dtype=np.uint8)
    dst = _aligned(nbytes, 64, offset)
    batch = BatchChecksum(1, nbytes)
    chunk = batch._chunk
    used = native.copy_sum(dst, src, batch._sums[0], chunk)
    assert used in (path if platform.machine() in ("x86_64", "AMD64") else {"plain"})
    assert np.array_equal(dst, src)
    assert batch.result().tolist() == block_checksums(src.reshape(1, -1)).tolist()


def test_copy_add_detects_a_flipped_bit_on_the_way(native: Any) -> None:
    rows = np.random.default_rng(0).integers(0, 256, (3, 8192), dtype=np.uint8)
    expected = block_checksums(rows)
    rows[1, 4097] ^= 0x10
    out = np.empty_like(rows)
    batch = BatchChecksum(3, 8192)
    for i in range(3):
        batch.copy_add(i, out[i], rows[i])
    got = batch.result()
    assert got[0] == expected[0] and got[2] == expected[2] and got[1] != expected[1]
    assert np.array_equal(out, rows)


def test_copy_sum_rejects_bad_buffers(native: Any) -> None:
    src, sums = np.zeros(4096, np.uint8), np.zeros(1, np.uint64)
    with pytest.raises(ValueError, match="same length"):
        native.copy_sum(np.zeros(2048, np.uint8), src, sums, 512)
    with pytest.raises(ValueError, match="same length"):
        native.copy_sum(np.zeros(4096, np.uint8), src, sums, 3)  # 4096 B is not 24 B chunks
    with pytest.raises(ValueError, match="sums must hold 1"):
        native.copy_sum(np.zeros(4096, np.uint8), src, np.zeros(2, np.uint64), 512)
    with pytest.raises(TypeError, match="dst must be a contiguous writable"):
        native.copy_sum(bytes(4096), src, sums, 512)
    with pytest.raises(TypeError, match="src must be a contiguous"):
        native.copy_sum(np.zeros(4096, np.uint8), np.zeros((2, 4096), np.uint8)[:, ::2], sums, 512)


def test_fallback_without_the_kernel_gives_the_same_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = np.random.default_rng(1).integers(0, 256, (4, 3 * 4096), dtype=np.uint8)
    readonly = rows.copy()
    readonly.flags.writeable = False
    monkeypatch.setattr(checksum_mod, "_copysum", None)
    for src in (rows, readonly):
        out = np.empty_like(rows)
        batch = BatchChecksum(4, rows.shape[1])
        for i in (3, 1, 0, 2):
            batch.copy_add(i, out[i], src[i])
        assert batch.result().tolist() == block_checksums(rows).tolist()
        assert np.array_equal(out, rows)
