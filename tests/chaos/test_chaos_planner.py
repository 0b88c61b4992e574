"""The planner's flip under load over Ray (issue 49): 1P2D of workers that serve either role
(`--planner act`), six greedy streams of 128 tokens; the busiest decode worker drains (1 s), the
streams it still holds move to the other decode worker, and it re-registers as a prefill worker.
Every stream ends with the undisturbed tokens, nothing leaks, and the flipped worker then
prefills a request. Its own module: the workers' Ray names are shared with the other chaos
clusters."""

from __future__ import annotations

import pytest

from halfmoon.conductor.planner import PlannerConfig, Split
from halfmoon.kvpool.redis_server import EmbeddedRedis
from halfmoon.sim.advisor import SimAdvisor, live_config
from tests.chaos.conftest import MAX_TOKENS
from tests.chaos.support import Streams, assert_no_leaks
from tests.e2e.support import generate_all, start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# the planner acts, but never by itself in this test (an hour between ticks): the test moves
PLANNER = PlannerConfig(mode="act", interval_s=3600.0, drain_s=1.0)


def test_a_decode_worker_flipped_to_prefill_under_load_loses_no_stream(tmp_path_factory: pytest.TempPathFactory,
                                                                       redis: EmbeddedRedis, short: tuple) -> None:
    ids, want = short
    api = start_cluster(tmp_path_factory.mktemp("chaos-planner"), 1, 2, redis, planner=PLANNER,
                        advisor=lambda b: SimAdvisor(live_config(b), b.cost))
    try:
        streams = Streams(api.grpc_target, ids, MAX_TOKENS, warm=8)
        streams.wait_started()
        manager = api.backend.manager
        leaving = max(manager.role("decode"), key=lambda w: len(w.bound.jobs))
        held = len(leaving.bound.jobs)
        api.call(api.backend.rebalancer.flip(leaving, "prefill", PLANNER.drain_s), timeout=120)
        assert streams.finish() == want
        assert held >= 1, "the flipped worker held streams when it left"
        assert api.backend.rebalancer.split() == Split(2, 1)
        assert leaving.spec.role == "prefill" and leaving in manager.role("prefill")
        assert api.backend.stats().requests_rerun.get("migrated", 0) >= 1
        # the flipped worker prefills: the first prefill worker out of the way, a request runs
        other = next(w for w in manager.role("prefill") if w is not leaving)
        other.state = "draining"
        try:
            assert generate_all(api.grpc_target, [ids[0]], [MAX_TOKENS]) == [want[0]]
        finally:
            other.state = "ready"
        assert_no_leaks(api)
    finally:
        api.stop()
