"""Cluster index against a real redis-server: exact match lengths, tiers, two-phase put, leases,
liveness, two processes, and Redis faults (down, restarted, never there)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from halfmoon.kvpool.cluster_index import (
    BadBlockHashError,
    BadHolderIdError,
    ClusterIndex,
    HolderId,
    IndexClosedError,
    IndexUnavailableError,
)
from halfmoon.kvpool.redis_server import EmbeddedRedis, EmbeddedRedisError, free_port
from halfmoon.kvpool.tiers import Tier
from tests.kvpool.conftest import IndexFactory
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
LOGGER = "halfmoon.kvpool.cluster_index"


def chain(n: int, tag: int = 0) -> list[bytes]:
    """`n` distinct 16-byte block hashes (distinct per `tag`)."""
    return [tag.to_bytes(8, "big") + i.to_bytes(8, "big") for i in range(n)]


class FakeClock:
    """A monotonic clock the test moves by hand (`ClusterIndex(clock=...)`)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def outage_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.WARNING and "unreachable" in r.message]


# ------------------------------------------------------------------- lookups


def test_match_length_per_holder_with_overlapping_prefixes(make_index: IndexFactory) -> None:
    a, b, reader = make_index("A"), make_index("B"), make_index("reader")
    blocks = chain(10)
    a.publish(blocks, Tier.DEVICE)
    b.publish(blocks[:5] + blocks[6:], Tier.HOST)  # B misses block 5

    result = reader.lookup(blocks)

    assert result.num_blocks == 10 and not result.degraded
    assert result.match_len(a.holder) == 10
    assert result.match_len(b.holder) == 5
    assert result.match_len(reader.holder) == 0 and result.match(reader.holder) is None
    assert result.best is not None and result.best.holder == a.holder
    assert result.match(a.holder).tier == Tier.DEVICE
    assert result.match(b.holder).tier == Tier.HOST
    assert [m.holder for m in result.matches] == [a.holder, b.holder]


def test_tier_is_slowest_needed_and_best_copy_counts(make_index: IndexFactory) -> None:
    a, reader = make_index("A"), make_index("reader")
    blocks = chain(6)
    a.publish(blocks[:2], Tier.DEVICE)
    a.publish(blocks[2:4], Tier.HOST)
    a.publish(blocks[4:], Tier.DISK)
    a.publish(blocks[4:5], Tier.HOST)  # block 4 in HOST and DISK: the HOST copy counts

    match = reader.lookup(blocks).match(a.holder)

    assert match is not None
    assert (match.length, match.tier, match.blocks_per_tier) == (6, Tier.DISK, (2, 3, 1))
    assert reader.lookup(blocks[:4]).match(a.holder).tier == Tier.HOST


def test_prefix_only_counts_from_block_zero(make_index: IndexFactory) -> None:
    a, reader = make_index("A"), make_index("reader")
    blocks = chain(8)
    a.publish(blocks[1:], Tier.DEVICE)  # everything but block 0

    assert reader.lookup(blocks).matches == ()
    assert reader.lookup(blocks).best is None
    assert reader.lookup([]).num_blocks == 0
    assert reader.lookup(chain(3, tag=9)).matches == ()


def test_ties_prefer_the_faster_tier(make_index: IndexFactory) -> None:
    a, b, reader = make_index("A"), make_index("B"), make_index("reader")
    blocks = chain(4)
    a.publish(blocks, Tier.DISK)
    b.publish(blocks, Tier.DEVICE)

    assert reader.lookup(blocks).best.holder == b.holder


def test_bad_block_hashes_and_holder_ids_are_rejected(make_index: IndexFactory) -> None:
    a = make_index("A")
    with pytest.raises(BadBlockHashError):
        a.lookup([b"short"])
    with pytest.raises(BadBlockHashError):
        a.publish(["0123456789abcdef"], Tier.HOST)  # type: ignore[list-item]
    with pytest.raises(BadHolderIdError):
        HolderId("w@x", "node")
    with pytest.raises(BadHolderIdError):
        HolderId("w", "")
    assert HolderId.from_key(HolderId("w", "n@1").key) == HolderId("w", "n@1")


# ------------------------------------------------------------------- two-phase put


def test_reserve_is_invisible_until_publish(make_index: IndexFactory) -> None:
    a, reader = make_index("A"), make_index("reader")
    blocks = chain(4)

    assert a.reserve(blocks, Tier.DEVICE) == blocks
    assert reader.lookup(blocks).matches == ()
    assert a.reserve(blocks + chain(1, tag=5), Tier.DEVICE) == chain(1, tag=5)  # only the new

    a.publish(blocks[:2], Tier.DEVICE)
    assert reader.lookup(blocks).match_len(a.holder) == 2
    assert a.reserve(blocks[:2], Tier.DEVICE) == []  # published: nothing to write
    assert a.reserve(blocks[:2], Tier.HOST) == blocks[:2]  # another tier is another copy


def test_reservation_expires_if_never_published(make_index: IndexFactory) -> None:
    a = make_index("A", reservation_ttl_s=1.0)  # 1 s for the next call to see it reserved
    blocks = chain(3)
    assert a.reserve(blocks, Tier.HOST) == blocks
    assert a.reserve(blocks, Tier.HOST) == []
    # Reservations expire on the Redis server's clock: wait for it (reserving again then
    # returns every block; until then it returns none and changes nothing).
    wait_until(lambda: a.reserve(blocks, Tier.HOST) == blocks, timeout_s=15,
               what="the reservation to expire")


def test_remove_one_tier_or_all(make_index: IndexFactory) -> None:
    a, reader = make_index("A"), make_index("reader")
    blocks = chain(4)
    a.publish(blocks, Tier.DEVICE)
    a.publish(blocks, Tier.HOST)

    a.remove(blocks[2:], Tier.DEVICE)
    match = reader.lookup(blocks).match(a.holder)
    assert (match.length, match.tier, match.blocks_per_tier) == (4, Tier.HOST, (2, 2, 0))

    a.remove(blocks[1:2])
    assert reader.lookup(blocks).match_len(a.holder) == 1
    assert a.held(Tier.HOST) == {blocks[0], blocks[2], blocks[3]}


def test_move_demotes_atomically(make_index: IndexFactory) -> None:
    a, reader = make_index("A"), make_index("reader")
    blocks = chain(4)
    a.publish(blocks, Tier.DEVICE)
    a.move(blocks[2:], Tier.DEVICE, Tier.DISK)

    match = reader.lookup(blocks).match(a.holder)
    assert (match.length, match.tier, match.blocks_per_tier) == (4, Tier.DISK, (2, 0, 2))
    assert a.held(Tier.DEVICE) == set(blocks[:2]) and a.held(Tier.DISK) == set(blocks[2:])


@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["publish", "remove", "move"]),
                              st.integers(0, 2), st.sampled_from(list(Tier)),
                              st.sampled_from(list(Tier)), st.sets(st.integers(0, 7))),
                    max_size=25))
def test_lookup_matches_a_reference_model(redis_server: EmbeddedRedis,
                                          ops: list[tuple[str, int, Tier, Tier, set[int]]]) -> None:
    """Random publish/remove/move by 3 holders; every lookup equals the plain-Python answer."""
    namespace = f"p{uuid.uuid4().hex[:12]}"
    holders = [ClusterIndex(redis_server.url, HolderId(f"h{i}", "n"), namespace=namespace)
               for i in range(3)]
    model: list[dict[bytes, set[Tier]]] = [{} for _ in holders]
    blocks = chain(8)
    try:
        for verb, who, tier, other, picked in ops:
            hashes = [blocks[i] for i in sorted(picked)]
            _apply_to_model(model[who], verb, hashes, tier, other)
            getattr(holders[who], verb)(hashes, *((tier, other) if verb == "move" else (tier,)))
        result = holders[0].lookup(blocks)
        for index, held in zip(holders, model):
            assert result.match_len(index.holder) == _model_prefix(held, blocks)
    finally:
        for index in holders:
            index.close()


def _apply_to_model(held: dict[bytes, set[Tier]], verb: str, hashes: list[bytes], tier: Tier,
                    other: Tier) -> None:
    for h in hashes:
        tiers = held.setdefault(h, set())
        if verb == "publish":
            tiers.add(tier)
        elif verb == "remove":
            tiers.discard(tier)
        elif tier != other:
            tiers.discard(tier)
            tiers.add(other)


def _model_prefix(held: dict[bytes, set[Tier]], blocks: list[bytes]) -> int:
    length = 0
    while length < len(blocks) and held.get(blocks[length]):
        length += 1
    return length


# ------------------------------------------------------------------- liveness


def test_dead_holder_is_filtered_at_once_and_collected_lazily(make_index: IndexFactory) -> None:
    a = make_index("A", heartbeat_ttl_s=2.0)  # no heartbeat thread: dies after 2 s
    reader = make_index("reader")
    blocks = chain(5)
    a.publish(blocks, Tier.HOST)
    assert reader.lookup(blocks).match_len(a.holder) == 5
    assert a.holder in reader.live_holders()

    wait_until(lambda: reader.lookup(blocks).matches == (), timeout_s=15,
               what="A's heartbeat to expire on the Redis server's clock")
    assert reader.live_holders() == {reader.holder}

    assert reader.heartbeat()  # declares A dead
    client = redis.Redis.from_url(reader.url)
    dead_key = f"{reader.settings.namespace}:dead"
    assert client.zcard(dead_key) == 1
    for _ in range(10_000):  # one full SCAN cycle over the session server's keys
        reader.gc_step()
        if client.zcard(dead_key) == 0:
            break
    assert reader.stats.gc_pruned == 5
    assert client.keys(f"{reader.settings.namespace}:b:*") == []

    assert a.heartbeat()  # the zombie wakes up: re-registers and re-publishes
    assert reader.lookup(blocks).match_len(a.holder) == 5
    assert a.stats.resyncs == 1 and a.stats.republished_blocks == 5


def test_background_heartbeat_keeps_holder_alive_and_close_leaves(
        make_index: IndexFactory) -> None:
    a = make_index("A", heartbeat_ttl_s=2.0).start()  # heartbeats every 0.67 s
    reader = make_index("reader")
    blocks = chain(3)
    a.publish(blocks, Tier.DEVICE)
    time.sleep(2.5)  # the thing under test: A outlives its 2 s TTL only by heartbeating
    assert reader.lookup(blocks).match_len(a.holder) == 3

    a.close()
    assert reader.lookup(blocks).matches == ()
    with pytest.raises(IndexClosedError):
        a.lookup(blocks)


# ------------------------------------------------------------------- leases


def test_leases_are_reported_to_the_owner_until_released(make_index: IndexFactory) -> None:
    owner, reader1, reader2 = make_index("owner"), make_index("r1"), make_index("r2")
    blocks = chain(6)
    owner.publish(blocks, Tier.DEVICE)

    lease1 = reader1.acquire_lease(owner.holder, blocks[:3], ttl_s=10)
    lease2 = reader2.acquire_lease(owner.holder, blocks[2:4], ttl_s=10)
    assert owner.leased(blocks) == set(blocks[:4])
    assert reader1.leased(blocks) == set()  # leases are per holder

    reader1.release_lease(lease1)
    assert owner.leased(blocks) == set(blocks[2:4])  # block 2 still leased by reader 2
    reader2.release_lease(lease2)
    reader2.release_lease(lease2)  # idempotent
    assert owner.leased(blocks) == set()


def test_lease_expires_after_its_ttl(make_index: IndexFactory) -> None:
    owner, reader = make_index("owner"), make_index("reader")
    blocks = chain(2)
    reader.acquire_lease(owner.holder, blocks, ttl_s=1.0)  # 1 s for the next call to see it
    assert owner.leased(blocks) == set(blocks)
    wait_until(lambda: owner.leased(blocks) == set(), timeout_s=15,
               what="the lease to expire on the Redis server's clock")
    with pytest.raises(ValueError):
        reader.acquire_lease(owner.holder, blocks, ttl_s=reader.settings.max_lease_ttl_s + 1)


# ------------------------------------------------------------------- two processes


def test_another_process_sees_published_blocks_with_their_tier(redis_server: EmbeddedRedis,
                                                               make_index: IndexFactory,
                                                               namespace: str) -> None:
    child = textwrap.dedent(f"""
        import sys
        from halfmoon.kvpool.cluster_index import ClusterIndex, HolderId
        from halfmoon.kvpool.tiers import Tier
        blocks = [(0).to_bytes(8, "big") + i.to_bytes(8, "big") for i in range(8)]
        with ClusterIndex({redis_server.url!r}, HolderId("A", "node-a"),
                          namespace={namespace!r}) as index:
            index.publish(blocks[:6], Tier.HOST)
            print("published", flush=True)
            sys.stdin.read()  # stay alive (and registered) until the parent is done
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "published"
        reader = make_index("B", "node-b")
        match = reader.lookup(chain(8)).best
        assert match is not None
        assert (match.holder, match.length, match.tier) == (HolderId("A", "node-a"), 6, Tier.HOST)
    finally:
        proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert reader.lookup(chain(8)).matches == ()  # the child closed: its entries left with it


# ------------------------------------------------------------------- round trips


def test_lookup_is_one_round_trip(private_redis: EmbeddedRedis,
                                  make_private_index: IndexFactory,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    a, reader = make_private_index("A"), make_private_index("reader")
    blocks = chain(64)
    a.publish(blocks, Tier.DEVICE)
    reader.lookup(blocks)  # warm up: connection handshake, script load

    sends = []
    original = redis.connection.Connection.send_packed_command

    def counting(self: redis.connection.Connection, command: object, *args: object,
                 **kwargs: object) -> None:
        sends.append(command)
        original(self, command, *args, **kwargs)

    monitor = redis.Redis.from_url(private_redis.url)
    before = _command_calls(monitor)
    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counting)
    result = reader.lookup(blocks)
    monkeypatch.undo()
    after = _command_calls(monitor)

    assert result.match_len(a.holder) == 64
    assert len(sends) == 1  # one write to the socket, one reply read
    delta = {cmd: n - before.get(cmd, 0) for cmd, n in after.items() if n != before.get(cmd, 0)}
    delta.pop("info", None)  # the monitor's own INFO
    # One command from the client; commandstats also counts the commands the script runs
    # inside the server: the clock, the live holders, two MGETs (blocks 0-7, which end most
    # misses early, then 8-63), the epoch, and the name of the one holder that matched.
    assert delta == {"evalsha": 1, "time": 1, "zrangebyscore": 1, "mget": 2, "get": 1,
                     "hget": 1}


def _command_calls(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


# ------------------------------------------------------------------- faults


def test_redis_down_degrades_then_recovers_and_republishes(
        private_redis: EmbeddedRedis, make_private_index: IndexFactory,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    clock = FakeClock()  # times the lease blackout after the outage
    a = make_private_index("A", max_lease_ttl_s=1.0, clock=clock)
    blocks = chain(6)
    a.publish(blocks[:4], Tier.DEVICE)
    assert a.lookup(blocks).match_len(a.holder) == 4

    private_redis.stop()
    result = a.lookup(blocks)
    assert result.degraded and result.matches == () and not a.healthy
    assert a.lookup(blocks).degraded
    a.publish(blocks[4:], Tier.DEVICE)  # remembered locally
    a.remove(blocks[:1], Tier.DEVICE)
    a.publish(blocks[:1], Tier.HOST)
    assert a.leased(blocks) == set(blocks)  # lease records unreadable: evict nothing
    with pytest.raises(IndexUnavailableError):
        a.acquire_lease(a.holder, blocks, ttl_s=1.0)
    assert a.stats.redis_errors >= 3
    assert len(outage_warnings(caplog)) == 1
    assert private_redis.url in outage_warnings(caplog)[0].message

    private_redis.start()  # same port, empty
    match = a.lookup(blocks).match(a.holder)
    assert a.healthy and a.stats.resyncs == 1 and a.stats.republished_blocks == 6
    assert (match.length, match.tier, match.blocks_per_tier) == (6, Tier.HOST, (5, 1, 0))
    assert any("reachable again" in r.message for r in caplog.records)
    assert len(outage_warnings(caplog)) == 1
    assert a.leased(blocks) == set(blocks)  # leases taken before the outage may still run
    clock.advance(1.0)  # max_lease_ttl_s after the outage began: pre-outage leases are over
    assert a.leased(blocks) == set()


def test_the_background_thread_probes_a_lost_redis_sooner_than_a_beat(
        private_redis: EmbeddedRedis, make_private_index: IndexFactory) -> None:
    """Back within about `retry_interval_s` of Redis' return with no request touching the index
    (a beat is 7.5 s here): what the soak's Redis kills measure as serving again."""
    a = make_private_index("A", heartbeat_ttl_s=30.0, retry_interval_s=0.1).start()
    blocks = chain(3)
    a.publish(blocks, Tier.HOST)
    private_redis.stop()
    assert a.lookup(blocks).degraded and not a.healthy

    private_redis.start()  # same port, empty
    wait_until(lambda: a.healthy, timeout_s=5.0, what="the heartbeat thread's probe re-syncing A")
    assert a.stats.resyncs == 1
    assert a.stats.republished_blocks == 3 and a.lookup(blocks).match_len(a.holder) == 3


def test_silent_redis_restart_is_noticed_and_repopulated(
        private_redis: EmbeddedRedis, make_private_index: IndexFactory,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    a, reader = make_private_index("A"), make_private_index("reader")
    blocks = chain(5)
    a.publish(blocks, Tier.HOST)

    private_redis.restart()  # both clients reconnect transparently; the index is empty
    assert reader.lookup(blocks).matches == ()
    assert a.heartbeat()  # finds itself forgotten: re-registers and re-publishes

    assert reader.lookup(blocks).match_len(a.holder) == 5
    assert a.stats.resyncs == 1
    assert any("had lost holder" in r.message for r in caplog.records)
    assert not any("unreachable" in r.message for r in caplog.records)


def test_holder_nums_of_an_old_redis_epoch_are_never_reused(
        private_redis: EmbeddedRedis, make_private_index: IndexFactory) -> None:
    """After a restart the new server hands out nums 1, 2, ... again; a holder that has not
    noticed the restart yet must not write under a num that now belongs to someone else."""
    a, b = make_private_index("A"), make_private_index("B")  # nums 1 and 2
    private_redis.restart()
    b.publish(chain(2, tag=1), Tier.HOST)  # B notices first and re-registers as num 1
    a.publish(chain(3), Tier.DEVICE)  # A still holds num 1 of the old epoch

    result = b.lookup(chain(3))
    assert result.match_len(a.holder) == 3 and result.match_len(b.holder) == 0
    assert b.lookup(chain(2, tag=1)).best.holder == b.holder
    assert a.reserve(chain(3), Tier.DEVICE) == []  # reservations use A's new num too


def test_redis_never_started_degrades_without_crashing(
        make_index: IndexFactory, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    url = f"redis://127.0.0.1:{free_port()}/0"
    a = make_index("A", url_override=url, retry_interval_s=60.0)
    blocks = chain(3)

    assert not a.healthy
    assert a.lookup(blocks).degraded
    a.publish(blocks, Tier.DISK)
    assert a.held(Tier.DISK) == set(blocks)
    assert a.reserve(chain(2, tag=1), Tier.DISK) == chain(2, tag=1)
    assert a.reserve(chain(2, tag=1), Tier.DISK) == []
    assert not a.heartbeat() and a.live_holders() == set()
    assert a.stats.redis_errors == 1 and a.stats.degraded_calls == 6  # retry back-off
    assert len(outage_warnings(caplog)) == 1
    assert url in outage_warnings(caplog)[0].message


def test_embedded_redis_names_the_binary_it_failed_to_start(tmp_path: Path) -> None:
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\necho 'no such server' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(EmbeddedRedisError, match=r"redis-server.*exited with code 3"):
        EmbeddedRedis(executable=fake).start()
    with pytest.raises(EmbeddedRedisError, match="no such server"):
        EmbeddedRedis(executable=fake).start()
