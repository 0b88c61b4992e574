"""A tensor-parallel worker is down as one (issue 35): kill -9 of one follower rank of a TP=2
decode worker while six greedy streams of 128 tokens run. Its rank 0 learns of it (the rank
watch, or the step's failed collective) and the actor exits, so Ray restarts the whole worker
(both ranks anew) and the Conductor moves every stream it held (the migration path): each
finishes with the undisturbed tokens, no client error. Its own module: the workers' Ray names
are shared with the other chaos clusters."""

from __future__ import annotations

import os
import signal

import pytest

from tests.chaos.conftest import MAX_TOKENS
from tests.chaos.support import Streams, all_alive, assert_no_leaks
from tests.e2e.support import start_cluster
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def rank_pids(api, worker_id: str) -> list[int]:  # noqa: ANN001
    import ray

    return ray.get(api.backend.manager.workers[worker_id].api.handle.rank_pids.remote(), timeout=30)


def test_kill9_of_a_decode_rank_restarts_the_worker_and_every_stream_completes(
        tmp_path_factory: pytest.TempPathFactory, short: tuple) -> None:
    ids, want = short
    api = start_cluster(tmp_path_factory.mktemp("chaos-tp"), 1, 1, None, decode_tp=2, migration_stall_s=180.0)
    try:
        before = rank_pids(api, "decode-0")
        assert len(before) == 2, before
        streams = Streams(api.grpc_target, ids, MAX_TOKENS, warm=8)
        streams.wait_started()
        worker = api.backend.manager.workers["decode-0"]
        restarts = worker.restarts
        os.kill(before[1], signal.SIGKILL)  # a follower rank, not the actor's process
        assert streams.finish() == want
        wait_until(lambda: worker.restarts > restarts and all_alive(api), timeout_s=120, what="decode-0 restarted")
        after = rank_pids(api, "decode-0")
        assert len(after) == 2 and not set(after) & set(before), "both ranks restarted as one worker"
        assert api.backend.stats().requests_rerun.get("migrated", 0) >= 1, "the streams it held moved"
        assert_no_leaks(api)
    finally:
        api.stop()
