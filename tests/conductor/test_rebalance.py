"""The planner's moves on a live cluster (conductor/rebalance.py): real SmolLM2 workers that serve
either role (conductor/flex_worker.py) in this process, the real KV transport over loopback, the
Conductor's own request path. A worker flipped or removed under streaming requests loses none:
each stream ends with the greedy text of an undisturbed run; ledgers, reservations and blocks
come back."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from halfmoon.conductor.backend import GenerationInput
from halfmoon.conductor.cluster import ClusterBackend
from halfmoon.conductor.planner import PlannerConfig, Split
from halfmoon.conductor.rebalance import RebalanceError
from halfmoon.conductor.workers import Worker
from halfmoon.core.messages import TokenChunk
from halfmoon.core.params import SamplingParams
from halfmoon.engine.engine import Engine
from halfmoon.engine.loader import LoadedWeights
from halfmoon.sim.advisor import SimAdvisor, live_config
from tests.e2e.support import cost_model_file
from tests.workers_support import InProcessWorkers, cluster_config, settled, tokens

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROMPTS = ("The capital of France is", "Write a short poem about the sea.", "List three prime numbers:",
           "Once upon a time, in a village by the river,")
PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)
RUN_S = 120.0


class Live:
    """A started backend on its own event loop, its in-process workers."""

    def __init__(self, loop: asyncio.AbstractEventLoop, backend: ClusterBackend, workers: InProcessWorkers) -> None:
        self.loop, self.backend, self.workers = loop, backend, workers

    def run(self, coro, timeout_s: float = RUN_S):
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout_s))

    def busiest(self, role: str) -> Worker:
        return max(self.backend.manager.role(role), key=lambda w: len(w.bound.jobs) + len(w.pending.jobs))

    async def problems(self) -> list[str]:
        apis = [w.api for w in self.backend.manager.workers.values()]
        return await settled(apis)  # type: ignore[arg-type]


@pytest.fixture
def live(smollm2_weights: LoadedWeights, tmp_path: Path) -> Iterator[Live]:
    """1 prefill + 2 decode flexible workers; the planner acting, but never ticking by itself
    (an hour between ticks): the tests make its moves."""
    planner = PlannerConfig(mode="act", interval_s=3600.0, window_s=600.0)
    config = cluster_config(cost_model=cost_model_file(tmp_path / "cost.json"), prefill=1, decode=2,
                            planner=planner)
    workers = InProcessWorkers(config, smollm2_weights)
    backend = ClusterBackend(config, redis_url=None, workers=workers,
                             advisor=lambda b: SimAdvisor(live_config(b), b.cost))
    loop = asyncio.new_event_loop()
    running = Live(loop, backend, workers)
    try:
        running.run(backend.start())
        yield running
    finally:
        running.run(backend.stop())
        loop.close()


def expected(engine: Engine) -> list[list[int]]:
    return [engine.generate([engine.tokenizer.encode(p)], PARAMS)[0].output_ids for p in PROMPTS]


async def streams_then(live: Live, engine: Engine, move, after_chunks: int = 3) -> tuple[list[list[TokenChunk]], object]:
    """Every prompt streaming; once each has `after_chunks` chunks, `move()`; every stream's
    chunks and what the move returned."""
    got: list[list[TokenChunk]] = [[] for _ in PROMPTS]
    started = asyncio.Event()

    async def stream(i: int) -> None:
        inp = GenerationInput(engine.tokenizer.encode(PROMPTS[i]), PARAMS, request_id=f"s{i}")
        async for chunk in live.backend.generate(inp):
            got[i].append(chunk)
            if all(len(g) >= after_chunks for g in got):
                started.set()

    tasks = [asyncio.ensure_future(stream(i)) for i in range(len(PROMPTS))]
    await asyncio.wait_for(started.wait(), RUN_S)
    moved = await move()
    await asyncio.gather(*tasks)
    return got, moved


def test_a_decode_worker_flipped_under_streams_keeps_every_stream_s_greedy_text(live: Live, engine: Engine) -> None:
    want = expected(engine)

    async def flip():
        leaving = live.busiest("decode")
        held = len(leaving.bound.jobs)
        await live.backend.rebalancer.flip(leaving, "prefill", drain_s=0.2)
        return leaving, held

    got, (flipped, held) = live.run(streams_then(live, engine, flip))

    assert [tokens(g) for g in got] == want
    assert held >= 1, "the flipped worker was decoding when it left"
    assert live.backend.stats().requests_rerun.get("migrated", 0) >= 1
    assert live.backend.rebalancer.split() == Split(2, 1)
    assert flipped.spec.role == "prefill" and flipped in live.backend.manager.role("prefill")
    assert not flipped.bound.jobs and not flipped.pending.jobs
    # it serves as a prefill worker now: the other prefill worker out of the way, a request runs there
    other = next(w for w in live.backend.manager.role("prefill") if w is not flipped)
    other.state = "draining"
    try:
        chunks = live.run(_collect(live.backend, engine.tokenizer.encode(PROMPTS[0]), "after-flip"))
    finally:
        other.state = "ready"
    assert tokens(chunks) == want[0]
    assert chunks[-1].end is not None and chunks[-1].end.prefill_worker == flipped.worker_id
    assert live.run(live.problems()) == []


def test_a_decode_worker_removed_while_requests_hold_its_reservations_loses_none(live: Live,
                                                                                  engine: Engine) -> None:
    want = expected(engine)

    async def remove():
        leaving = live.busiest("decode")
        load = await leaving.api.load()
        await live.backend.rebalancer.remove(leaving, drain_s=0.0)
        return leaving, len(leaving.bound.jobs), load

    got, (removed, left_jobs, load) = live.run(streams_then(live, engine, remove, after_chunks=1))

    assert [tokens(g) for g in got] == want
    assert load.requests >= 1 or load.reserved >= 1, "it held requests and their KV when removed"
    assert left_jobs == 0
    assert live.workers.removed == [removed] and removed.worker_id not in live.backend.manager.workers
    assert live.backend.rebalancer.split() == Split(1, 1)
    assert live.run(live.problems()) == []


def test_an_added_worker_serves_and_a_pool_of_one_cannot_shrink(live: Live, engine: Engine) -> None:
    added = live.run(live.backend.rebalancer.add("prefill"))
    assert added.worker_id == "prefill-1" and live.backend.rebalancer.split() == Split(2, 2)
    first = live.backend.manager.role("prefill")[0]
    first.state = "draining"
    try:
        chunks = live.run(_collect(live.backend, engine.tokenizer.encode(PROMPTS[2]), "on-added"))
    finally:
        first.state = "ready"
    assert chunks[-1].end is not None and chunks[-1].end.prefill_worker == "prefill-1"
    live.run(live.backend.rebalancer.remove(added, drain_s=1.0))
    with pytest.raises(RebalanceError, match="prefill pool has 1 ready worker"):
        live.run(live.backend.rebalancer.apply(_decision(Split(1, 2), Split(0, 3)), 1.0))
    assert live.run(live.problems()) == []


def test_the_planner_ticks_on_the_traffic_it_saw_and_shows_its_decision(live: Live, engine: Engine) -> None:
    for i, prompt in enumerate(PROMPTS):
        live.run(_collect(live.backend, engine.tokenizer.encode(prompt), f"seen-{i}"))
    assert live.backend.planner is not None
    decision = live.run(live.backend.planner.tick())
    snapshot = live.backend.stats().planner
    assert snapshot is not None and snapshot.decisions[-1] == decision
    assert set(decision.scores) == {"1P2D", "2P1D"}
    assert snapshot.split == Split(1, 2) or decision.applied
    view = snapshot.view()
    assert view["mode"] == "act" and view["decisions"][-1]["reason"] == decision.reason


async def _collect(backend: ClusterBackend, prompt: list[int], rid: str) -> list[TokenChunk]:
    return [c async for c in backend.generate(GenerationInput(prompt, PARAMS, request_id=rid))]


def _decision(current: Split, target: Split):
    from halfmoon.conductor.planner import Decision, step_toward

    action, role = step_toward(current, target)
    return Decision(0.0, action, current, target, "test", role)
