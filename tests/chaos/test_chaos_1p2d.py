"""Faults without client errors, 1P2D (issue 19): kill -9 of one decode worker while six greedy
streams of 128 tokens run; the streams it held move to the other decode worker at once, without
waiting for the restart, and finish with the undisturbed tokens. Its own module: the 1P1D
cluster of test_chaos.py is gone before this one starts (the workers' Ray names are shared)."""

from __future__ import annotations

import time

import pytest

from halfmoon.kvpool.redis_server import EmbeddedRedis
from tests.chaos.conftest import MAX_TOKENS
from tests.chaos.support import Streams, all_alive, assert_no_leaks, kill9
from tests.e2e.support import start_cluster
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

def test_1p2d_the_other_decode_worker_takes_over_without_waiting(tmp_path_factory: pytest.TempPathFactory,
                                                                  redis: EmbeddedRedis, short: tuple) -> None:
    ids, want = short
    api = start_cluster(tmp_path_factory.mktemp("chaos-1p2d"), 1, 2, redis)
    try:
        streams = Streams(api.grpc_target, ids, MAX_TOKENS, warm=8)
        streams.wait_started()
        victim = max(api.backend.manager.role("decode"), key=lambda w: len(w.bound.jobs)).worker_id
        restarts = api.backend.manager.workers[victim].restarts
        killed = time.monotonic()
        kill9(api, victim)
        assert streams.finish() == want
        wait_until(lambda: api.backend.manager.workers[victim].restarts > restarts and all_alive(api), timeout_s=60,
                   what=f"{victim} restarted")
        restart_s = time.monotonic() - killed
        # The moved streams went on on the live decode worker: none paused as long as a restart.
        assert streams.longest_stall_s < restart_s, (streams.longest_stall_s, restart_s)
        assert_no_leaks(api)
    finally:
        api.stop()
