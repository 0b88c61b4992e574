"""Faults without client errors (issue 19), with real processes: a 1P1D and a 1P2D cluster (Ray
worker processes, TCP KV transport, embedded Redis), six concurrent greedy streams of 128 tokens,
and a fault struck while every stream is mid-flight:

- kill -9 (by pid) of the decode worker, of the prefill worker, of Redis;
- every KV connection of the prefill worker dropped mid-push.

Each test asserts every stream completes with the undisturbed greedy tokens (no client-visible
error) and that nothing leaked (reservations, blocks, the Conductor's ledgers, each worker's own
integrity check). Waits are on observable state with deadlines (tests/waiting.py).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from halfmoon.engine.engine import Engine
from halfmoon.kvpool.redis_server import EmbeddedRedis
from tests.chaos.conftest import MAX_TOKENS, STREAMS, prompts
from tests.chaos.support import Streams, all_alive, assert_no_leaks, kill9
from tests.conductor.conftest import RunningApi
from tests.e2e.support import reference, start_cluster, worker_load
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
# The six streams of 128 tokens for the worker kills; Redis and the dropped connections
# only need streams in flight (shorter: the whole suite stays under 3 minutes).
REDIS_TOKENS, DROP_TOKENS = 64, 32

@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis: EmbeddedRedis) -> Iterator[RunningApi]:
    api = start_cluster(tmp_path_factory.mktemp("chaos-1p1d"), 1, 1, redis)
    yield api
    api.stop()


def restarted(api: RunningApi, worker_id: str, before: int) -> bool:
    return api.backend.manager.workers[worker_id].restarts > before and all_alive(api)


def test_decode_worker_killed_mid_stream(cluster: RunningApi, short: tuple) -> None:
    ids, want = short
    migrated = cluster.backend.stats().requests_rerun.get("migrated", 0)
    restarts = cluster.backend.manager.workers["decode-0"].restarts
    streams = Streams(cluster.grpc_target, ids, MAX_TOKENS, warm=8)
    streams.wait_started()
    kill9(cluster, "decode-0")
    assert streams.finish() == want
    assert cluster.backend.stats().requests_rerun["migrated"] >= migrated + STREAMS
    wait_until(lambda: restarted(cluster, "decode-0", restarts), timeout_s=60, what="decode-0 restarted")
    assert_no_leaks(cluster)


def test_prefill_worker_killed_with_requests_queued_and_in_flight(cluster: RunningApi, short: tuple) -> None:
    ids, want = short
    restarts = cluster.backend.manager.workers["prefill-0"].restarts
    # A fresh cache salt: nothing of the last run is cached, every prompt is computed again.
    streams = Streams(cluster.grpc_target, ids, MAX_TOKENS, cache_salt="prefill-kill")
    prefill = cluster.backend.manager.workers["prefill-0"]
    wait_until(lambda: prefill.pending.depth >= 1, timeout_s=60, what="prefills queued on prefill-0")
    kill9(cluster, "prefill-0")
    assert streams.finish() == want
    wait_until(lambda: restarted(cluster, "prefill-0", restarts), timeout_s=60, what="prefill-0 restarted")
    assert_no_leaks(cluster)


def test_redis_killed_under_load_then_back(cluster: RunningApi, redis: EmbeddedRedis, short: tuple,
                                          engine: Engine) -> None:
    ids, want = short
    index = cluster.backend.index
    assert index is not None and index.healthy
    streams = Streams(cluster.grpc_target, ids, REDIS_TOKENS, warm=4, cache_salt="redis-kill")
    streams.wait_started()
    os.kill(redis._proc.pid, signal.SIGKILL)  # noqa: SLF001 - kill -9 of the server by pid is the fault
    # New requests while Redis is gone are served from the workers' own caches.
    late = Streams(cluster.grpc_target, [ids[0][:-1]], 8)
    assert late.finish() == reference(engine, [ids[0][:-1]], [8])
    assert streams.finish() == [w[:REDIS_TOKENS] for w in want]  # greedy: a prefix of the longer run
    wait_until(lambda: not index.healthy, timeout_s=30, what="the index noticing Redis is gone")
    assert any("Redis" in r for r in cluster.backend.degraded())  # what /health reports
    redis.start()
    back = time.monotonic()
    wait_until(lambda: index.healthy and not cluster.backend.degraded(), timeout_s=10,
               what="the index re-synced within 10 s of Redis coming back")
    assert time.monotonic() - back <= 10
    assert_no_leaks(cluster)


def test_dropped_kv_connections_mid_push(cluster: RunningApi, engine: Engine) -> None:
    import ray

    ids = prompts(engine, 250)  # ~300-token prompts: pushes of two chunks each
    want = reference(engine, ids, [DROP_TOKENS] * STREAMS)
    prefill = cluster.backend.manager.workers["prefill-0"]
    computed = worker_load(cluster, "prefill-0").prompt_tokens_computed
    streams = Streams(cluster.grpc_target, ids, DROP_TOKENS)
    wait_until(lambda: worker_load(cluster, "prefill-0").prompt_tokens_computed > computed, timeout_s=60,
               what="a prefill chunk computed (its layers pushed)")
    dropped = wait_until(lambda: ray.get(prefill.api.handle.drop_kv_connections.remote(), timeout=30),  # type: ignore[union-attr]
                         timeout_s=30, what="an open KV connection to drop")
    assert dropped >= 1
    assert streams.finish() == want
    assert_no_leaks(cluster)


def test_a_request_arriving_while_every_prefill_worker_is_down_waits_for_the_restart(
        cluster: RunningApi, short: tuple) -> None:
    """Found by `halfmoon bench soak`: new requests during the only prefill worker's restart were
    UNAVAILABLE at once ("no live prefill worker"); they wait for it within --migration-stall-s."""
    ids, want = short
    prefill = cluster.backend.manager.workers["prefill-0"]
    restarts = prefill.restarts
    kill9(cluster, "prefill-0")
    wait_until(lambda: not prefill.alive, timeout_s=30, what="the Conductor seeing prefill-0 down")
    streams = Streams(cluster.grpc_target, ids[:2], MAX_TOKENS, cache_salt="arrive-while-down")
    assert streams.finish() == want[:2]
    wait_until(lambda: restarted(cluster, "prefill-0", restarts), timeout_s=60, what="prefill-0 restarted")
    assert_no_leaks(cluster)
