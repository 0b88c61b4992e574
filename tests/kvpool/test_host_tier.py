"""HostArena on tiny arenas (4-8 slots of 64 B): exact LRU order, pins, corruption, two
processes sharing one arena, and 10,000 random operations against a reference model, with
check_integrity() after every verb."""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import random
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from halfmoon.kvpool.checksum import BatchChecksum, block_checksums, checksum
from halfmoon.kvpool.errors import HashStateError, TierClosedError, TierLayoutError
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

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def make_arena() -> Iterator[Callable[..., Any]]:
    """`make_arena(num_slots=4, ...)` -> a Checked HostArena, unlinked after the test."""
    made: list[HostArena] = []

    def make(num_slots: int = 4, slot_bytes: int = SLOT_BYTES, **kwargs: Any) -> Any:
        arena = HostArena.create(f"hm-test-{uuid.uuid4().hex[:12]}", num_slots, slot_bytes,
                                 **kwargs)
        made.append(arena)
        return Checked(arena)

    yield make
    for arena in made:
        arena.unlink()


@pytest.fixture
def arena(make_arena: Callable[..., Any]) -> Any:
    return make_arena()


# --- the checksum (persisted by the disk tier's manifest: it must never change) ------------


def test_checksum_golden_values() -> None:
    rows = np.frombuffer(hashlib.shake_128(b"golden").digest(2 * 8192), np.uint8).reshape(2, 8192)
    assert block_checksums(rows).tolist() == [7734012779791282611, 2337071876648556680]
    assert checksum(bytes(64)) == 16309137577984334075  # all-zero blocks do not sum to 0
    assert checksum(np.arange(72, dtype=np.uint8)) == 1395036465596607220  # chunks of 72 B


def test_checksum_catches_flips_and_misplaced_chunks_and_batches_agree() -> None:
    rows = np.stack([content(key(i), 3 * 4096) for i in range(4)])
    base = block_checksums(rows)
    batch = BatchChecksum(4, rows.shape[1])
    for i in (2, 0, 3, 1):
        batch.add(i, rows[i])
    assert batch.result().tolist() == base.tolist()
    rng = random.Random(0)
    for _ in range(200):
        flipped = rows.copy()
        flipped[1, rng.randrange(rows.shape[1])] ^= 1 << rng.randrange(8)
        assert block_checksums(flipped).tolist()[1] != base[1]
    swapped = rows.copy()
    swapped[2, :4096], swapped[2, 4096:8192] = rows[2, 4096:8192], rows[2, :4096]
    assert block_checksums(swapped)[2] != base[2]
    with pytest.raises(ValueError):
        block_checksums(np.zeros((1, 12), np.uint8))


# --- put / get / lookups -------------------------------------------------------------------


def test_put_then_get_round_trips_bytes_from_tensors_arrays_and_views(arena: Any) -> None:
    a, b, c = key("a"), key("b"), key("c")
    result = arena.put([a, b], torch.from_numpy(blocks([a, b])))
    assert result == PutResult([True, True], [])
    assert arena.put([c], [content(c).tobytes()]).stored == [True]  # a list of byte buffers
    dst = torch.zeros(4, SLOT_BYTES, dtype=torch.uint8)
    assert arena.get([c, key("missing"), a, b], dst) == [True, False, True, True]
    assert np.array_equal(dst.numpy(), np.stack([content(c), np.zeros(SLOT_BYTES, np.uint8),
                                                 content(a), content(b)]))
    assert arena.contains([a, key("x"), c]) == [True, False, True]
    assert arena.match_prefix([a, b, key("x"), c]) == 2
    assert arena.match_prefix([]) == 0
    assert (arena.num_used(), arena.num_free(), arena.capacity) == (3, 1, 4)
    assert (arena.stats.hits, arena.stats.misses, arena.stats.stored) == (3, 1, 3)


def test_rows_take_ascending_free_slots(arena: Any) -> None:
    keys = [key(i) for i in range(3)]
    arena.put(keys, blocks(keys))
    assert [arena.tier._lookup(k) for k in keys] == [0, 1, 2]


def test_put_of_a_present_block_only_touches_it(arena: Any) -> None:
    a, b = key("a"), key("b")
    arena.put([a, b], blocks([a, b]))
    assert arena.put([a], np.zeros((1, SLOT_BYTES), np.uint8)) == PutResult([True], [])
    dst = np.zeros((1, SLOT_BYTES), np.uint8)
    arena.get([a], dst)
    assert np.array_equal(dst[0], content(a))  # not overwritten by the second put
    assert arena.lru_order() == [b, a]
    assert arena.stats.stored == 2


def test_duplicate_hashes_in_one_call(arena: Any) -> None:
    a = key("a")
    assert arena.put([a, a], blocks([a, a])).stored == [True, True]
    assert arena.num_used() == 1
    dst = np.zeros((2, SLOT_BYTES), np.uint8)
    assert arena.get([a, a], dst) == [True, True]
    assert np.array_equal(dst, blocks([a, a]))


def test_empty_calls_change_nothing(arena: Any) -> None:
    assert arena.put([], np.zeros((0, SLOT_BYTES), np.uint8)) == PutResult([], [])
    assert arena.get([], np.zeros((0, SLOT_BYTES), np.uint8)) == []
    assert arena.pin([]) == [] and arena.contains([]) == []
    arena.unpin([])
    assert arena.num_free() == arena.capacity


# --- LRU order -----------------------------------------------------------------------------


def test_eviction_is_least_recently_used_first(make_arena: Callable[..., Any]) -> None:
    arena = make_arena(num_slots=4)
    a, b, c, d, e, f = (key(x) for x in "abcdef")
    for k in (a, b, c, d):
        arena.put([k], blocks([k]))
    arena.get([a], np.zeros((1, SLOT_BYTES), np.uint8))  # a becomes the most recent
    assert arena.lru_order() == [b, c, d, a]
    assert arena.put([e], blocks([e])).evicted == [b]
    assert arena.contains([b]) == [False]
    arena.pin([c])  # c is now the oldest, but pinned
    assert arena.put([f], blocks([f])).evicted == [d]
    assert arena.lru_order() == [c, a, e, f]
    assert arena.stats.evictions == 2


def test_one_call_touches_its_blocks_tail_first(arena: Any) -> None:
    """The last block of a request is the least shareable, so it is evicted first."""
    keys = [key(i) for i in range(4)]
    arena.put(keys, blocks(keys))
    assert arena.lru_order() == keys[::-1]
    assert arena.put([key(9)], blocks([key(9)])).evicted == [keys[3]]
    arena.get([keys[2], keys[0]], np.zeros((2, SLOT_BYTES), np.uint8))
    assert arena.lru_order() == [keys[1], key(9), keys[0], keys[2]]  # the first is newest


def test_a_put_never_evicts_its_own_present_blocks(arena: Any) -> None:
    keys = [key(i) for i in range(4)]
    arena.put(keys, blocks(keys))
    new = [key(10), key(11)]
    # keys[3] is the oldest, but this put lists it: the next two oldest go instead.
    result = arena.put([keys[3], *new], blocks([keys[3], *new]))
    assert result == PutResult([True, True, True], [keys[2], keys[1]])


def test_blocks_that_find_no_room_are_not_stored(arena: Any) -> None:
    keys = [key(i) for i in range(4)]
    arena.put(keys, blocks(keys))
    arena.pin(keys[:3])
    new = [key(10), key(11)]
    assert arena.put(new, blocks(new)) == PutResult([True, False], [keys[3]])
    assert arena.contains(new) == [True, False]


def test_more_blocks_than_slots_stores_the_leading_ones(arena: Any) -> None:
    keys = [key(i) for i in range(6)]
    assert arena.put(keys, blocks(keys)).stored == [True] * 4 + [False] * 2


# --- pins ----------------------------------------------------------------------------------


def test_pinned_blocks_are_never_evicted(arena: Any) -> None:
    keys = [key(i) for i in range(4)]
    arena.put(keys, blocks(keys))
    assert arena.pin([keys[0], keys[0], key("absent")]) == [True, True, False]
    for i in range(10, 30):
        arena.put([key(i)], blocks([key(i)]))
        assert arena.contains([keys[0]]) == [True]
    assert arena.pins(keys[0]) == 2
    arena.unpin([keys[0], keys[0]])
    arena.put([key(99)], blocks([key(99)]))
    assert arena.contains([keys[0]]) == [False]


def test_unpin_more_than_pinned_raises_and_changes_nothing(arena: Any) -> None:
    a, b = key("a"), key("b")
    arena.put([a, b], blocks([a, b]))
    arena.pin([a])
    with pytest.raises(HashStateError) as info:
        arena.unpin([a, b])  # b holds no pin: a must keep its pin too
    assert info.value.block_hash == b
    assert arena.pins(a) == 1
    with pytest.raises(HashStateError):
        arena.unpin([a, a])
    with pytest.raises(HashStateError):
        arena.unpin([key("absent")])
    assert pickle.loads(pickle.dumps(info.value)).block_hash == b


# --- bad input leaves the arena unchanged ---------------------------------------------------


@pytest.mark.parametrize("bad", [
    lambda a: a.put([key(1)], np.zeros((2, SLOT_BYTES), np.uint8)),       # row count
    lambda a: a.put([key(1)], np.zeros((1, SLOT_BYTES + 8), np.uint8)),   # row length
    lambda a: a.put([key(1)], np.zeros((1, SLOT_BYTES), np.int16)),       # dtype
    lambda a: a.put([b"short"], np.zeros((1, SLOT_BYTES), np.uint8)),     # hash length
    lambda a: a.put(key(1), np.zeros((1, SLOT_BYTES), np.uint8)),         # one bytes object
    lambda a: a.put([key(1)], np.zeros((1, SLOT_BYTES), np.uint8), [-1]),  # checksum
    lambda a: a.get([key(0)], np.zeros((1, SLOT_BYTES), np.uint8)[:, ::-1]),  # strided rows
    lambda a: a.get([key(0)], [b"\0" * SLOT_BYTES]),                      # read-only dst
    lambda a: a.pin(["not bytes"]),
])
def test_bad_input_raises_and_changes_nothing(arena: Any, bad: Callable[[Any], object]) -> None:
    arena.put([key(0)], blocks([key(0)]))
    before = (arena.lru_order(), arena.pins(key(0)), arena.num_free())
    with pytest.raises((ValueError, TypeError)):
        bad(arena)
    assert (arena.lru_order(), arena.pins(key(0)), arena.num_free()) == before


@pytest.mark.parametrize("num_slots, slot_bytes", [(0, 64), (4, 0), (4, 12), (-1, 64), (4, 6.4)])
def test_bad_geometry_is_rejected(num_slots: Any, slot_bytes: Any) -> None:
    with pytest.raises(ValueError):
        HostArena.create(f"hm-test-{uuid.uuid4().hex[:12]}", num_slots, slot_bytes)


# --- checksums: a corrupt block is a miss, dropped, never served -----------------------------


def test_a_flipped_byte_in_shared_memory_is_a_miss_and_is_dropped(
        arena: Any, caplog: pytest.LogCaptureFixture) -> None:
    a, b = key("a"), key("b")
    arena.put([a, b], blocks([a, b]))
    arena.tier._data[arena.tier._lookup(a), 17] ^= 0x01  # one bit, as DRAM rot would flip it
    dst = np.zeros((2, SLOT_BYTES), np.uint8)
    with caplog.at_level(logging.WARNING, logger="halfmoon.kvpool.host_tier"):
        assert arena.get([a, b], dst) == [False, True]
    assert "failed their checksum" in caplog.text
    assert np.array_equal(dst[1], content(b))
    assert arena.contains([a, b]) == [False, True]
    assert (arena.stats.corrupt_drops, arena.num_used()) == (1, 1)


def test_a_corrupt_checksum_entry_is_a_miss_too(arena: Any) -> None:
    a = key("a")
    arena.put([a], blocks([a]))
    arena.tier._sums[arena.tier._lookup(a)] ^= np.uint64(1 << 40)
    assert arena.get([a], np.zeros((1, SLOT_BYTES), np.uint8)) == [False]
    assert arena.contains([a]) == [False]


def test_a_pinned_corrupt_block_is_never_served_and_dropped_after_unpin(arena: Any) -> None:
    a = key("a")
    arena.put([a], blocks([a]))
    arena.pin([a])
    arena.tier._data[arena.tier._lookup(a), 0] ^= 0xFF
    dst = np.zeros((1, SLOT_BYTES), np.uint8)
    assert arena.get([a], dst) == [False]
    assert arena.contains([a]) == [True]  # someone holds it: not dropped under them
    arena.unpin([a])
    assert arena.get([a], dst) == [False]
    assert arena.contains([a]) == [False]


def test_supplied_checksums_are_stored_as_given(arena: Any) -> None:
    a, b = key("a"), key("b")
    sums = block_checksums(blocks([a, b]))
    arena.put([a, b], blocks([a, b]), checksums=[int(sums[0]), int(sums[1]) ^ 1])
    assert arena.get([a, b], np.zeros((2, SLOT_BYTES), np.uint8)) == [True, False]


# --- eviction callback (demotion) -----------------------------------------------------------


def test_on_evict_gets_the_evicted_bytes_and_their_checksums(
        make_arena: Callable[..., Any]) -> None:
    seen: list[tuple[list[bytes], np.ndarray, list[int]]] = []

    def on_evict(ev: EvictedBlocks) -> None:
        seen.append((ev.hashes, np.stack(ev.blocks).copy(), ev.checksums.tolist()))

    arena = make_arena(num_slots=2, on_evict=on_evict)
    keys = [key(i) for i in range(4)]
    arena.put(keys[:2], blocks(keys[:2]))
    arena.put(keys[2:], blocks(keys[2:]))
    (hashes, data, sums), = seen
    assert hashes == [keys[1], keys[0]]  # oldest first: the first put was touched tail-first
    assert np.array_equal(data, blocks(hashes))
    assert sums == block_checksums(blocks(hashes)).tolist()


def test_a_failing_on_evict_frees_the_reserved_slots_and_raises(
        make_arena: Callable[..., Any]) -> None:
    def on_evict(ev: EvictedBlocks) -> None:
        raise RuntimeError("disk tier exploded")

    arena = make_arena(num_slots=2, on_evict=on_evict)
    keys = [key(i) for i in range(3)]
    arena.put(keys[:2], blocks(keys[:2]))
    with pytest.raises(RuntimeError, match="exploded"):
        arena.put(keys[2:], blocks(keys[2:]))
    assert arena.contains(keys) == [True, False, False]  # the victim is gone, nothing leaked
    assert arena.num_free() == 1


# --- two-phase put: a WRITING slot is invisible ----------------------------------------------


def test_a_reserved_slot_is_invisible_until_published(arena: Any) -> None:
    a = key("a")
    inner = arena.tier
    with inner._locked():
        plan = inner._reserve([a])
    assert arena.contains([a]) == [False] and arena.match_prefix([a]) == 0
    assert arena.get([a], np.zeros((1, SLOT_BYTES), np.uint8)) == [False]
    assert arena.pin([a]) == [False]
    assert arena.put([a], blocks([a])).stored == [True]  # being written: not written twice
    assert arena.num_used() == 1
    with inner._locked():
        inner._abort(plan)
    assert arena.num_free() == arena.capacity


def test_reclaim_orphans_frees_slots_of_dead_writers(arena: Any) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    a = key("a")
    inner = arena.tier
    with inner._locked():
        plan = inner._reserve([a])
        inner._pids[plan.slots] = int(dead.stdout)
    assert arena.reclaim_orphans() == 1
    assert arena.num_free() == arena.capacity
    assert arena.put([a], blocks([a])).stored == [True]
    assert arena.reclaim_orphans() == 0


# --- lifecycle ------------------------------------------------------------------------------


def test_attach_shares_state_and_validates_the_segment(arena: Any) -> None:
    a = key("a")
    arena.put([a], blocks([a]))
    other = HostArena.attach(arena.name)
    try:
        assert (other.capacity, other.slot_bytes) == (arena.capacity, arena.slot_bytes)
        assert other.contains([a]) == [True]
        other.put([key("b")], blocks([key("b")]))
        assert arena.lru_order() == [a, key("b")]
    finally:
        other.close()
    with pytest.raises(FileExistsError):
        HostArena.create(arena.name, 4, SLOT_BYTES)
    missing = f"hm-test-missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(FileNotFoundError):
        HostArena.attach(missing)
    assert not any(name.startswith(missing) for name in os.listdir("/dev/shm"))


def test_attach_to_a_segment_that_is_not_an_arena_raises(arena: Any) -> None:
    header = arena.tier._header
    header["magic"] ^= 1  # someone else's segment under that name
    try:
        with pytest.raises(TierLayoutError):
            HostArena.attach(arena.name)
    finally:
        header["magic"] ^= 1


def test_a_closed_handle_raises_and_close_is_idempotent(make_arena: Callable[..., Any]) -> None:
    arena = make_arena().tier
    arena.close()
    arena.close()
    with pytest.raises(TierClosedError):
        arena.contains([key("a")])
    assert "closed" in repr(arena)


def test_unlink_removes_the_segment_and_its_lock_file() -> None:
    name = f"hm-test-{uuid.uuid4().hex[:12]}"
    arena = HostArena.create(name, 4, SLOT_BYTES)
    assert os.path.exists(f"/dev/shm/{name}")
    arena.unlink()
    assert _arena_files(name) == []


def _arena_files(name: str) -> list[str]:
    return [f for f in (f"/dev/shm/{name}", f"/dev/shm/{name}.halfmoon.lock", f"/dev/shm/{name}.halfmoon.users")
            if os.path.exists(f)]


def test_release_removes_the_arena_only_when_the_last_handle_leaves() -> None:
    name = f"hm-test-{uuid.uuid4().hex[:12]}"
    first = HostArena.create(name, 4, SLOT_BYTES)
    second = HostArena.attach(name)
    assert len(_arena_files(name)) == 3
    assert first.release() is False  # `second` is still attached
    assert len(_arena_files(name)) == 3
    assert HostArena.attach(name).release() is False  # a third comes and goes; `second` stays
    assert second.release() is True
    assert _arena_files(name) == []
    assert second.release() is False  # idempotent on a closed handle


def test_a_killed_attacher_does_not_keep_the_arena_alive() -> None:
    """A worker that died never releases; the kernel drops its hold, so the survivor's release
    still removes the node's arena."""
    name = f"hm-test-{uuid.uuid4().hex[:12]}"
    arena = HostArena.create(name, 4, SLOT_BYTES)
    hold = textwrap.dedent("""
        import sys
        from halfmoon.kvpool.host_tier import HostArena
        HostArena.attach(sys.argv[1])
        print("attached", flush=True)
        sys.stdin.read()
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.Popen([sys.executable, "-c", hold, name], cwd=REPO_ROOT, env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "attached"
        other = HostArena.attach(name)
        assert other.release() is False  # the child holds it
        child.kill()
        child.wait(timeout=30)
        assert arena.release() is True
    finally:
        child.kill()
        child.wait(timeout=30)
    assert _arena_files(name) == []


# --- two processes, one arena ---------------------------------------------------------------

CHILD = textwrap.dedent("""
    import hashlib, random, sys
    import numpy as np
    from halfmoon.kvpool.host_tier import HostArena

    def key(i):
        return hashlib.sha256(f"block-{i}".encode()).digest()[:16]

    def content(k, n):
        return np.frombuffer(hashlib.shake_128(k).digest(n), dtype=np.uint8)

    name, mode = sys.argv[1], sys.argv[2]
    arena = HostArena.attach(name)
    n = arena.slot_bytes
    print("ready", flush=True)
    if mode == "swap":  # read what the parent put, then put our own blocks
        parent = [key(f"parent-{i}") for i in range(3)]
        dst = np.zeros((3, n), np.uint8)
        assert arena.get(parent, dst) == [True] * 3, "parent's blocks not visible"
        assert all(np.array_equal(dst[i], content(k, n)) for i, k in enumerate(parent))
        mine = [key(f"child-{i}") for i in range(3)]
        assert arena.put(mine, np.stack([content(k, n) for k in mine])).stored == [True] * 3
    else:  # stress: random puts and gets racing the parent's
        rng = random.Random(int(mode))
        keys = [key(f"race-{i}") for i in range(12)]
        for _ in range(400):
            batch = rng.sample(keys, rng.randint(1, 4))
            if rng.random() < 0.5:
                arena.put(batch, np.stack([content(k, n) for k in batch]))
            else:
                dst = np.zeros((len(batch), n), np.uint8)
                for row, hit in enumerate(arena.get(batch, dst)):
                    assert not hit or np.array_equal(dst[row], content(batch[row], n))
    arena.check_integrity()
    arena.close()
    print("child ok")
""")


def run_child(name: str, mode: str) -> subprocess.Popen[str]:
    """Start a process that attaches arena `name`; returns once it has attached."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, name, mode], cwd=REPO_ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout is not None
    ready = child.stdout.readline()
    if ready.strip() != "ready":
        child.kill()
        pytest.fail(f"child did not attach: {ready!r} {child.communicate()[1]}")
    return child


def wait_ok(child: subprocess.Popen[str]) -> None:
    # Not communicate(): it reads the raw pipe and would miss output that `run_child`'s readline
    # already pulled into the text buffer (a fast child's "child ok" arrives with "ready").
    assert child.stdout is not None and child.stderr is not None
    child.wait(timeout=120)
    out, err = child.stdout.read(), child.stderr.read()
    assert child.returncode == 0 and "child ok" in out, err


def test_two_processes_see_each_others_blocks(make_arena: Callable[..., Any]) -> None:
    arena = make_arena(num_slots=8)
    parent = [key(f"parent-{i}") for i in range(3)]
    arena.put(parent, blocks(parent))
    wait_ok(run_child(arena.name, "swap"))
    mine = [key(f"child-{i}") for i in range(3)]
    dst = np.zeros((3, SLOT_BYTES), np.uint8)
    assert arena.get(mine, dst) == [True] * 3
    assert np.array_equal(dst, blocks(mine))
    assert arena.contains(parent) == [True] * 3


def test_two_processes_racing_on_one_arena_keep_it_consistent(
        make_arena: Callable[..., Any]) -> None:
    arena = make_arena(num_slots=6)
    child = run_child(arena.name, "7")
    rng = random.Random(8)
    keys = [key(f"race-{i}") for i in range(12)]
    for _ in range(400):
        batch = rng.sample(keys, rng.randint(1, 4))
        if rng.random() < 0.5:
            arena.put(batch, blocks(batch))
        else:
            dst = np.zeros((len(batch), SLOT_BYTES), np.uint8)
            for row, hit in enumerate(arena.get(batch, dst)):
                assert not hit or np.array_equal(dst[row], content(batch[row]))
    wait_ok(child)
    assert arena.stats.corrupt_drops == 0
    assert arena.num_used() == 6 and all(arena.pins(k) == 0 for k in keys)


# --- 10,000 random operations against the model ------------------------------------------


def test_random_operations_match_the_model_and_leak_nothing(
        make_arena: Callable[..., Any]) -> None:
    arena = make_arena(num_slots=8)
    random_ops(arena, LruModel(8), seed=1234, steps=10_000)
