"""Warm standbys under a kill -9 (issue 37), with real Ray worker processes: a 1P1D cluster with
one standby per role (`standby=1`: four worker processes), six greedy streams of 128 tokens. The
killed worker's streams move to the promoted standby at once and finish with the undisturbed
tokens; Ray's restart of the killed actor is warmed up and becomes the new standby, as /health
and /metrics show. Its own module: the workers' Ray names are shared with test_chaos.py's."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from halfmoon.kvpool.redis_server import EmbeddedRedis
from tests.chaos.conftest import MAX_TOKENS
from tests.chaos.support import Streams, assert_no_leaks, kill9
from tests.conductor.conftest import RunningApi
from tests.e2e.support import start_cluster
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
NEW_STANDBY_S = 120.0  # Ray's restart (~3.5 s of imports), the engine's load and the warm-up, on 2 loaded cores


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis: EmbeddedRedis) -> Iterator[RunningApi]:
    api = start_cluster(tmp_path_factory.mktemp("chaos-standby"), 1, 1, redis, standby=1)
    yield api
    api.stop()


def kill_and_check(api: RunningApi, role: str, streams: Streams, want: list[list[int]]) -> None:
    """kill -9 `role`'s serving worker; the streams finish as undisturbed, a standby took its place
    at once (the killed one's restart is not waited for), and the killed one becomes the standby."""
    manager = api.backend.manager
    victim, spare = manager.role(role)[0].worker_id, next(w.worker_id for w in manager.standbys.values()
                                                           if w.spec.role == role)
    promotions = manager.promotions
    killed = time.monotonic()
    kill9(api, victim)
    assert streams.finish() == want
    assert manager.promotions == promotions + 1
    assert [w.worker_id for w in manager.role(role)] == [spare]
    wait_until(lambda: manager.standbys[victim].state == "standby" and manager.standbys[victim].alive,
               timeout_s=NEW_STANDBY_S, what=f"{victim} restarted and warmed up as the new standby")
    back_s = time.monotonic() - killed
    # The streams went on on the standby: none paused as long as the killed worker's way back.
    assert streams.longest_stall_s < back_s, (streams.longest_stall_s, back_s)
    health = httpx.get(api.http_url + "/health").json()
    assert {"id": victim, "role": role, "state": "standby"} in health["standby"]
    metrics = httpx.get(api.http_url + "/metrics").text
    assert f'halfmoon_standby_workers{{role="{role}",state="standby"}} 1.0' in metrics
    assert_no_leaks(api)


def test_decode_worker_killed_mid_stream_standby_takes_over(cluster: RunningApi, short: tuple) -> None:
    ids, want = short
    assert sorted(cluster.backend.manager.standbys) == ["decode-1", "prefill-1"]
    streams = Streams(cluster.grpc_target, ids, MAX_TOKENS, warm=8)
    streams.wait_started()
    kill_and_check(cluster, "decode", streams, want)
    assert cluster.backend.stats().requests_rerun.get("migrated", 0) >= 1


def test_prefill_worker_killed_with_prefills_queued_standby_takes_over(cluster: RunningApi, short: tuple) -> None:
    ids, want = short
    streams = Streams(cluster.grpc_target, ids, MAX_TOKENS, cache_salt="standby-prefill-kill")
    prefill = cluster.backend.manager.role("prefill")[0]
    wait_until(lambda: prefill.pending.depth >= 1, timeout_s=60, what=f"prefills queued on {prefill.worker_id}")
    kill_and_check(cluster, "prefill", streams, want)
