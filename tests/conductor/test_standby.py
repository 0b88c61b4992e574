"""Warm standbys' promotion logic (conductor/workers.py) on real workers in this process: one
serving prefill + decode worker and one standby of each role (`ClusterConfig.standby = 1`), all on
the session's shared SmolLM2 weights. The kill -9 under load is tests/chaos/test_chaos_standby.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from halfmoon.conductor.cluster_config import ClusterConfig
from halfmoon.core.errors import ConfigError
from halfmoon.engine.loader import LoadedWeights
from halfmoon.engine.worker import WARM_UP_PROMPT_TOKENS, WARM_UP_TOKENS
from tests.workers_support import InProcessWorkers, cluster_config

HEALTH_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def group(smollm2_weights: LoadedWeights) -> Iterator[InProcessWorkers]:
    workers = InProcessWorkers(cluster_config(standby=1), smollm2_weights)
    workers.start(None)
    yield workers
    workers.stop()


async def health_until(group: InProcessWorkers, worker_id: str, state: str) -> None:
    """Health checks (as the Conductor's loop runs them) until `worker_id` is in `state`."""
    deadline = time.monotonic() + HEALTH_DEADLINE_S
    while (w := {**group.workers, **group.standbys}[worker_id]).state != state:
        assert time.monotonic() < deadline, f"{worker_id} stayed {w.state}, not {state}"
        await group.check_health()
        await asyncio.sleep(0.05)  # the poll interval: warm-ups run in the background


def test_config_counts_and_names_the_standbys() -> None:
    config = ClusterConfig(prefill=2, decode=1, standby=1)
    specs = config.specs(None)
    assert [s.worker_id for s in specs] == ["prefill-0", "prefill-1", "prefill-2", "decode-0", "decode-1"]
    assert [s.worker_id for s in specs if config.is_standby(s)] == ["prefill-2", "decode-1"]
    assert (config.count("prefill"), config.count("decode", standby=False)) == (3, 1)
    with pytest.raises(ConfigError, match="standby"):
        ClusterConfig(standby=-1)


def test_standbys_start_warm_and_are_not_routed_to(group: InProcessWorkers) -> None:
    assert sorted(group.workers) == ["decode-0", "prefill-0"]
    assert sorted(group.standbys) == ["decode-1", "prefill-1"]
    assert {w.state for w in group.standbys.values()} == {"standby"}
    for w in group.standbys.values():  # the warm-up request ran through each standby's engine
        load = asyncio.run(w.api.load())
        assert (load.prompt_tokens_computed, load.decode_tokens) == (WARM_UP_PROMPT_TOKENS, WARM_UP_TOKENS - 1)
    assert [w.worker_id for w in group.role("decode")] == ["decode-0"]


def test_a_dead_worker_is_replaced_by_its_roles_standby_which_the_dead_one_becomes(
        group: InProcessWorkers) -> None:
    dead = group.workers["decode-0"]
    dead.alive = False  # what `_on` sets on a WorkerLostError
    promoted = group.promote(dead)
    assert promoted is not None and promoted.worker_id == "decode-1"
    assert [w.worker_id for w in group.role("decode")] == ["decode-1"]
    assert (promoted.state, dead.state) == ("promoting", "warming")
    assert group.promote(dead) is None  # no longer serving: a second report changes nothing
    assert group.role("prefill")[0].worker_id == "prefill-0"  # the other role untouched
    # The "dead" worker answers again (as Ray's restart would): warmed up, it is the new standby.
    asyncio.run(health_until(group, "decode-0", "standby"))
    assert group.workers["decode-1"].state == "ready"
    assert group.standbys["decode-0"].alive
    # It is promoted in turn on the next death; without a ready standby a death changes nothing.
    group.workers["decode-1"].alive = False
    assert group.promote(group.workers["decode-1"]).worker_id == "decode-0"  # type: ignore[union-attr]
    group.workers["decode-0"].alive = False
    assert group.promote(group.workers["decode-0"]) is None
    assert group.promotions == 2
    asyncio.run(health_until(group, "decode-1", "standby"))  # both answer: one serves, one stands by
    assert group.workers["decode-0"].alive and group.workers["decode-0"].state == "ready"
