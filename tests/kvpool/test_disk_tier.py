"""DiskTier on tiny slabs (4-8 slots of 64 B) in tmp_path: exact LRU order, pins, corrupt
slots, warm restart from the manifest, disk full / unwritable faults, and 10,000 random
operations against the reference model, with check_integrity() after every verb.

Faults are injected by monkeypatching os.pwrite / os.open: the tests run as root, which
ignores chmod, and a small tmpfs would need a mount.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from halfmoon.kvpool.checksum import block_checksums
from halfmoon.kvpool.disk_tier import MANIFEST_FILE, SLAB_FILE, DiskTier
from halfmoon.kvpool.errors import HashStateError, TierClosedError
from halfmoon.kvpool.host_tier import HostArena
from halfmoon.kvpool.tier_base import EvictedBlocks, PutResult
from tests.kvpool.tier_support import (
    SLOT_BYTES,
    Checked,
    LruModel,
    blocks,
    content,
    key,
    random_ops,
)


@pytest.fixture
def make_tier(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """`make_tier(capacity=4, directory=tmp_path/"tier", ...)` -> a Checked DiskTier."""
    made: list[DiskTier] = []

    def make(capacity: int = 4, directory: Path | None = None, **kwargs: Any) -> Any:
        tier = DiskTier(directory or tmp_path / "tier", SLOT_BYTES, capacity, **kwargs)
        made.append(tier)
        return Checked(tier)

    yield make
    for tier in made:
        tier.close()


@pytest.fixture
def tier(make_tier: Callable[..., Any]) -> Any:
    return make_tier()


def read(tier: Any, keys: list[bytes]) -> tuple[list[bool], np.ndarray]:
    dst = np.zeros((len(keys), SLOT_BYTES), np.uint8)
    return tier.get(keys, dst), dst


def flip_byte(directory: Path, offset: int) -> None:
    with open(directory / SLAB_FILE, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


# --- put / get / LRU -----------------------------------------------------------------------


def test_put_then_get_round_trips_bytes(tier: Any) -> None:
    a, b, c = key("a"), key("b"), key("c")
    assert tier.put([a, b], blocks([a, b])) == PutResult([True, True], [])
    assert tier.put([c], [content(c).tobytes()]).stored == [True]
    hits, dst = read(tier, [c, key("missing"), a, b])
    assert hits == [True, False, True, True]
    assert np.array_equal(dst[[0, 2, 3]], blocks([c, a, b]))
    assert tier.contains([a, key("x")]) == [True, False]
    assert tier.match_prefix([a, b, key("x"), c]) == 2
    assert (tier.num_used(), tier.num_free(), tier.capacity) == (3, 1, 4)


def test_put_async_returns_a_future(tier: Any) -> None:
    keys = [key(i) for i in range(3)]
    src = blocks(keys)
    futures = [tier.put_async([k], src[i : i + 1]) for i, k in enumerate(keys)]
    assert all(isinstance(f, Future) for f in futures)
    assert [f.result(timeout=30).stored for f in futures] == [[True]] * 3
    assert read(tier, keys)[0] == [True] * 3


def test_eviction_is_least_recently_used_first(tier: Any) -> None:
    a, b, c, d, e, f = (key(x) for x in "abcdef")
    for k in (a, b, c, d):
        tier.put([k], blocks([k]))
    read(tier, [a])
    assert tier.lru_order() == [b, c, d, a]
    assert tier.put([e], blocks([e])).evicted == [b]
    tier.pin([c])
    assert tier.put([f], blocks([f])).evicted == [d]
    assert tier.lru_order() == [c, a, e, f]
    assert read(tier, [c, a, e, f])[0] == [True] * 4


def test_one_call_touches_its_blocks_tail_first(tier: Any) -> None:
    keys = [key(i) for i in range(4)]
    tier.put(keys, blocks(keys))
    assert tier.lru_order() == keys[::-1]
    assert tier.put([key(9)], blocks([key(9)])).evicted == [keys[3]]


def test_pinned_blocks_are_never_evicted(tier: Any) -> None:
    keys = [key(i) for i in range(4)]
    tier.put(keys, blocks(keys))
    assert tier.pin([keys[0], key("absent")]) == [True, False]
    for i in range(10, 20):
        tier.put([key(i)], blocks([key(i)]))
        assert tier.contains([keys[0]]) == [True]
    tier.pin(keys[:1] + [key(19), key(18), key(17)])
    assert tier.put([key(50)], blocks([key(50)])) == PutResult([False], [])
    with pytest.raises(HashStateError):
        tier.unpin([keys[0], keys[0], keys[0]])
    assert tier.pins(keys[0]) == 2
    tier.unpin([keys[0], keys[0]])


def test_bad_input_raises_and_changes_nothing(tier: Any) -> None:
    tier.put([key(0)], blocks([key(0)]))
    before = (tier.lru_order(), tier.num_free())
    with pytest.raises(ValueError):
        tier.put([key(1)], np.zeros((1, SLOT_BYTES + 8), np.uint8))
    with pytest.raises(ValueError):
        tier.get([key(0)], [b"\0" * SLOT_BYTES])
    with pytest.raises(ValueError):
        tier.put([key(1)], blocks([key(1)]), checksums=[1, 2])
    assert (tier.lru_order(), tier.num_free()) == before
    with pytest.raises(ValueError):
        DiskTier(Path("/tmp/never"), 12, 4)


# --- corrupt slots -------------------------------------------------------------------------


def test_a_flipped_byte_in_the_slab_is_a_miss_dropped_with_a_warning(
        tier: Any, caplog: pytest.LogCaptureFixture) -> None:
    a, b = key("a"), key("b")
    tier.put([a, b], blocks([a, b]))
    flip_byte(tier.directory, tier.tier._index[a] * SLOT_BYTES + 40)
    with caplog.at_level(logging.WARNING, logger="halfmoon.kvpool.disk_tier"):
        hits, dst = read(tier, [a, b])
    assert hits == [False, True] and np.array_equal(dst[1], content(b))
    assert "failed their checksum" in caplog.text
    assert tier.contains([a, b]) == [False, True]
    assert tier.stats.corrupt_drops == 1 and tier.num_used() == 1


def test_a_short_read_is_a_miss(tier: Any) -> None:
    a = key("a")
    tier.put([a], blocks([a]))
    os.truncate(tier.directory / SLAB_FILE, 10)  # the slab lost its tail
    assert read(tier, [a])[0] == [False]
    assert tier.contains([a]) == [False]


def test_supplied_checksums_travel_with_the_block(tier: Any) -> None:
    a, b = key("a"), key("b")
    sums = block_checksums(blocks([a, b]))
    tier.put([a, b], blocks([a, b]), checksums=[int(sums[0]), int(sums[1]) ^ 1])
    assert read(tier, [a, b])[0] == [True, False]


# --- restart --------------------------------------------------------------------------------


def test_a_clean_restart_comes_back_warm_with_the_same_lru_order(
        make_tier: Callable[..., Any], tmp_path: Path) -> None:
    first = make_tier(capacity=4)
    keys = [key(i) for i in range(4)]
    first.put(keys, blocks(keys))
    read(first, [keys[3]])
    order = first.lru_order()
    first.close()
    assert (tmp_path / "tier" / MANIFEST_FILE).exists()
    second = make_tier(capacity=4)
    assert not (tmp_path / "tier" / MANIFEST_FILE).exists()  # consumed: a crash restarts cold
    assert second.lru_order() == order == [keys[2], keys[1], keys[0], keys[3]]
    hits, dst = read(second, keys)
    assert hits == [True] * 4 and np.array_equal(dst, blocks(keys))
    assert second.put([key(9)], blocks([key(9)])).evicted == [keys[3]]


def test_without_a_clean_close_the_next_open_is_cold(make_tier: Callable[..., Any]) -> None:
    first = make_tier(capacity=4)
    first.put([key(0)], blocks([key(0)]))
    second = make_tier(capacity=4)  # as after a crash of `first`: no manifest on disk
    assert second.contains([key(0)]) == [False] and second.num_free() == 4


def test_a_corrupt_manifest_starts_cold_with_a_warning(
        make_tier: Callable[..., Any], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = make_tier(capacity=4)
    first.put([key(0)], blocks([key(0)]))
    first.close()
    path = tmp_path / "tier" / MANIFEST_FILE
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="halfmoon.kvpool.disk_tier"):
        second = make_tier(capacity=4)
    assert "ignoring its manifest" in caplog.text
    assert second.contains([key(0)]) == [False]


def test_another_geometry_starts_cold(make_tier: Callable[..., Any]) -> None:
    first = make_tier(capacity=4)
    first.put([key(0)], blocks([key(0)]))
    first.close()
    second = make_tier(capacity=8)
    assert second.contains([key(0)]) == [False] and second.num_free() == 8


def test_a_closed_tier_raises(tier: Any) -> None:
    tier.close()
    tier.close()
    with pytest.raises(TierClosedError):
        tier.contains([key(0)])


# --- faults: disk full, unwritable -> read-only, nothing crashes -----------------------------


def fail_writes(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    def pwrite(fd: int, data: Any, offset: int) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "pwrite", pwrite)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_a_write_fault_makes_the_tier_read_only_with_one_warning(
        make_tier: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, code: int) -> None:
    tier = make_tier(capacity=4)
    held = [key(0), key(1)]
    tier.put(held, blocks(held))
    fail_writes(monkeypatch, code)
    with caplog.at_level(logging.WARNING, logger="halfmoon.kvpool.disk_tier"):
        assert tier.put([key(2), key(0)], blocks([key(2), key(0)])).stored == [False, True]
        assert tier.put([key(3)], blocks([key(3)])) == PutResult([False], [])
    assert tier.read_only
    assert len([r for r in caplog.records if "READ-ONLY" in r.getMessage()]) == 1
    assert tier.stats.write_errors == 2
    hits, dst = read(tier, held)  # what it holds stays readable
    assert hits == [True, True] and np.array_equal(dst, blocks(held))
    assert tier.num_used() == 2


def test_a_short_write_counts_as_disk_full(tier: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: real(fd, data[:10], offset))
    assert tier.put([key(0)], blocks([key(0)])).stored == [False]
    assert tier.read_only and tier.num_used() == 0


def test_a_fault_mid_put_keeps_the_blocks_already_written(
        tier: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwrite

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if offset >= 2 * SLOT_BYTES:  # the disk fills up after the first two slots
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    keys = [key(i) for i in range(4)]
    assert tier.put(keys, blocks(keys)).stored == [True, True, False, False]
    assert read(tier, keys[:2])[0] == [True, True]
    assert tier.stats.write_errors == 2


def test_a_warm_tier_in_an_unwritable_directory_opens_read_only(
        make_tier: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [key(0), key(1)]
    first = make_tier(capacity=4)
    first.put(keys, blocks(keys))
    first.close()
    real_open = os.open

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)  # chmod 0500 would not stop root
    second = make_tier(capacity=4)
    assert second.read_only
    hits, dst = read(second, keys)
    assert hits == [True, True] and np.array_equal(dst, blocks(keys))
    assert second.put([key(2)], blocks([key(2)])).stored == [False]
    second.close()
    monkeypatch.undo()
    third = make_tier(capacity=4)  # the manifest was left in place: still warm
    assert third.contains(keys) == [True, True] and not third.read_only


def test_a_directory_that_cannot_be_created_gives_an_empty_read_only_tier(
        make_tier: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "mkdir", refuse)
    monkeypatch.setattr(os, "open", refuse)
    tier = make_tier(capacity=4, directory=tmp_path / "nowhere" / "tier")
    assert tier.read_only
    assert tier.put([key(0)], blocks([key(0)])).stored == [False]
    assert read(tier, [key(0)])[0] == [False]
    tier.close()


def test_an_unexpected_os_error_raises_and_leaks_nothing(
        tier: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fail_writes(monkeypatch, errno.EBADF)  # a bug, not a full disk: must not be swallowed
    with pytest.raises(OSError) as info:
        tier.put([key(0)], blocks([key(0)]))
    assert info.value.errno == errno.EBADF
    assert not tier.read_only and tier.num_free() == 4


# --- demotion from the host arena -----------------------------------------------------------


def test_host_evictions_demote_to_disk_with_their_checksums(tier: Any) -> None:
    def demote(ev: EvictedBlocks) -> None:
        tier.put(ev.hashes, ev.blocks, ev.checksums)

    arena = HostArena.create(f"hm-test-demote-{os.getpid()}", 2, SLOT_BYTES, on_evict=demote)
    try:
        keys = [key(i) for i in range(4)]
        arena.put(keys[:2], blocks(keys[:2]))
        arena._data[arena._lookup(keys[0]), 5] ^= 0x10  # rots while in host memory
        arena.put(keys[2:], blocks(keys[2:]))
        assert tier.contains(keys) == [True, True, False, False]
        hits, dst = read(tier, keys[:2])
        assert hits == [False, True]  # the rot travelled with its checksum: never served
        assert np.array_equal(dst[1], content(keys[1]))
        arena.check_integrity()
    finally:
        arena.unlink()


# --- concurrency and 10,000 random operations ---------------------------------------------


def test_threads_sharing_a_tier_keep_it_consistent(make_tier: Callable[..., Any]) -> None:
    import random
    import threading

    tier = make_tier(capacity=6).tier
    keys = [key(f"t-{i}") for i in range(12)]
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                batch = rng.sample(keys, rng.randint(1, 3))
                if rng.random() < 0.5:
                    tier.put_async(batch, blocks(batch)).result(timeout=30)
                else:
                    hits, dst = read(tier, batch)
                    for row, hit in enumerate(hits):
                        assert not hit or np.array_equal(dst[row], content(batch[row]))
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    tier.check_integrity()
    assert tier.stats.corrupt_drops == 0 and tier.num_used() == 6


def test_random_operations_match_the_model_and_leak_nothing(
        make_tier: Callable[..., Any]) -> None:
    tier = make_tier(capacity=8)
    random_ops(tier, LruModel(8), seed=4321, steps=10_000)
