"""The disk tier on a disk that fills up and empties again (found by `halfmoon bench soak`'s enospc
fault): a real ENOSPC from a small tmpfs makes the tier read-only, and once space is back it
writes again after `retry_writes_s` instead of staying read-only for the life of the worker."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from halfmoon.kvpool.disk_tier import DiskTier
from tests.kvpool.tier_support import Checked, key
from tests.waiting import wait_until


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (root only: the suite and CI run as root; elsewhere the test says so)."""
    if os.geteuid() != 0:
        pytest.skip("NOT RUN: mounting a tmpfs for a real ENOSPC needs root")
    path = tmp_path / "small"
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"NOT RUN: mount -t tmpfs failed: {done.stderr.strip()}")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=True)


SLOT = 2 * 4096  # whole pages: a slot never shares a tmpfs page with another


def blocks(keys: list[bytes]) -> np.ndarray:
    """One SLOT-byte block per key, its bytes taken from the key."""
    return np.stack([np.resize(np.frombuffer(k, np.uint8), SLOT) for k in keys])


def fill(path: Path) -> None:
    """Write to `path` until the filesystem is full (a real ENOSPC)."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\1" * 4096)
        except OSError as err:
            assert err.errno == errno.ENOSPC, err


def test_a_full_disk_makes_the_tier_read_only_and_it_writes_again_once_space_is_back(
        small_disk: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = Checked(DiskTier(small_disk / "tier", SLOT, 8, retry_writes_s=0.2))
    try:
        held = [key(0)]
        assert tier.put(held, blocks(held)).stored == [True]
        ballast = small_disk / "ballast"
        fill(ballast)
        with caplog.at_level(logging.WARNING, logger="halfmoon.kvpool.disk_tier"):
            assert tier.put([key(1)], blocks([key(1)])).stored == [False]
        assert tier.read_only and tier.num_used() == 1
        assert any("READ-ONLY for" in r.getMessage() for r in caplog.records)
        ballast.unlink()
        wait_until(lambda: tier.put([key(2)], blocks([key(2)])).stored == [True], timeout_s=10,
                   what="the tier writing again after the ballast was removed")
        assert not tier.read_only
        got = np.zeros((2, SLOT), np.uint8)
        assert tier.get([key(0), key(2)], got) == [True, True]
        assert np.array_equal(got, blocks([key(0), key(2)]))
    finally:
        tier.close()


def test_a_fault_that_persists_backs_off(small_disk: Path) -> None:
    tier = Checked(DiskTier(small_disk / "tier", SLOT, 8, retry_writes_s=0.05))
    try:
        fill(small_disk / "ballast")
        assert tier.put([key(1)], blocks([key(1)])).stored == [False]
        first = tier.tier._retry_s
        wait_until(lambda: not tier.put([key(1)], blocks([key(1)])).stored[0] and tier.tier._retry_s > first,
                   timeout_s=10, what="a second fault after the retry")
        assert tier.read_only and tier.num_used() == 0
    finally:
        tier.close()
