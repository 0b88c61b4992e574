"""Prefill and decode workers in this process, no Ray: the worker classes themselves, on real
engines (the session's shared SmolLM2 weights) and the real KV transport over loopback.

```
InProcessWorkers(config, weights).start(None)      # a WorkerGroup, as ClusterBackend wants one
  workers["prefill-0"].api  -> PrefillWorker        # the object is its own PrefillApi
  workers["decode-0"].api   -> DecodeWorker         #   ... and DecodeApi
```

The KV goes over tcp on 127.0.0.1: the `local` backend keeps its addresses in the backend object,
and each worker makes its own (`TransportConfig.make_backend`), so a prefill worker cannot reach
a decode worker's `local://` receiver.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from unittest import mock

import pytest

import halfmoon.engine.engine as engine_module
from halfmoon.conductor.cluster_config import ClusterConfig
from halfmoon.conductor.flex_worker import FlexWorker
from halfmoon.conductor.workers import Worker, WorkerGroup
from halfmoon.core.messages import (DecodeTask, IntegrityError, PrefillResult, PrefillTask, TokenChunk,
                           WorkerLoad)
from halfmoon.core.params import SamplingParams
from halfmoon.decode_worker.worker import DecodeWorker
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.loader import LoadedWeights
from halfmoon.engine.config import WorkerSpec
from halfmoon.engine.worker import EngineWorker
from halfmoon.prefill_worker.worker import PrefillWorker
from tests.conftest import NUM_THREADS, idle_problems
from tests.waiting import poll
from halfmoon.transport.config import TransportConfig

TRANSPORT = TransportConfig(backend="tcp", host="127.0.0.1", timeout_s=20.0)
TIMEOUT_S = 60.0  # bound on one request through a pair (a few seconds on the 2-core machine)
SETTLE_S = 10.0  # aborts and released pushes take an engine step or an idle tick to land


def cluster_config(num_blocks: int = 128, max_num_batched_tokens: int = 64,
                   **fields: object) -> ClusterConfig:
    """One prefill + one decode worker on small fp32 SmolLM2 engines (prefills chunked by 64
    tokens, so a long prompt takes several steps), KV over loopback tcp."""
    engine = EngineConfig(model="smollm2", dtype="float32", num_blocks=num_blocks,
                          max_num_batched_tokens=max_num_batched_tokens, num_threads=NUM_THREADS)
    return ClusterConfig(**{"engine": engine, "transport": TRANSPORT, "request_timeout_s": TIMEOUT_S,
                            **fields})  # type: ignore[arg-type]


class InProcessWorkers(WorkerGroup):
    """The workers of a `ClusterConfig` as objects in this process (see the module docstring).

    Specs lose their CPU pinning: `EngineWorker` pins the thread that builds it, here the test's.
    """

    def __init__(self, config: ClusterConfig, weights: LoadedWeights) -> None:
        super().__init__()
        self.config = config
        self.weights = weights
        self.removed: list[Worker] = []  # workers stopped at run time (the planner's removes)

    def start(self, redis_url: str | None) -> None:
        """Every worker of the config; standbys (`--standby`) warmed up, as `RayWorkers` does."""
        for spec in self.config.specs(redis_url):
            api = start_worker(dataclasses.replace(spec, cpus=None), self.weights, self.flex)
            self.place(Worker(spec, api, pid=os.getpid()), self.config.is_standby(spec))  # type: ignore[arg-type]
        for w in self.standbys.values():
            asyncio.run(w.api.warm_up())

    @property
    def flex(self) -> bool:
        """Workers that serve either role (the planner acts: conductor/flex_worker.py)."""
        return self.config.planner.mode == "act"

    def _launch(self, spec: WorkerSpec) -> Worker:
        api = start_worker(dataclasses.replace(spec, cpus=None), self.weights, self.flex)
        asyncio.run(api.warm_up())
        return Worker(spec, api, pid=os.getpid())  # type: ignore[arg-type]

    def _shut(self, worker: Worker) -> None:
        self.removed.append(worker)
        worker.api.close()  # type: ignore[union-attr]

    def stop(self) -> None:
        for w in self.everyone():
            w.api.close()  # type: ignore[union-attr]
        self.workers.clear()
        self.standbys.clear()

    @property
    def prefill(self) -> PrefillWorker:
        return self.role("prefill")[0].api  # type: ignore[return-value]

    @property
    def decode(self) -> DecodeWorker:
        return self.role("decode")[0].api  # type: ignore[return-value]


def start_worker(spec: WorkerSpec, weights: LoadedWeights, flex: bool = False) -> PrefillWorker | DecodeWorker:
    """The worker of `spec`, its engine on `weights` (no second load of the model); `flex`: one
    that serves either role."""
    cls = FlexWorker if flex else PrefillWorker if spec.role == "prefill" else DecodeWorker
    with mock.patch.object(engine_module, "load_weights", return_value=weights):
        return cls(spec)


async def run_pair(prefill: PrefillWorker, decode: DecodeWorker, request_id: str,
                   prompt_ids: list[int], params: SamplingParams) -> tuple[PrefillResult, list[TokenChunk]]:
    """What the Conductor does for one request: reserve on the decode side, then the prefill
    and the decode stream at once; the prefill's result and every chunk, within TIMEOUT_S."""

    async def both() -> tuple[PrefillResult, list[TokenChunk]]:
        handoff = await decode.reserve(request_id, len(prompt_ids), params.max_tokens, TIMEOUT_S)
        task = PrefillTask(request_id, prompt_ids, params, None, handoff, TIMEOUT_S)
        prefilled = asyncio.ensure_future(prefill.prefill(task))
        try:
            chunks = await drain(decode.generate(DecodeTask(request_id, prompt_ids, params, None, TIMEOUT_S)))
        finally:
            outcome = await asyncio.gather(prefilled, return_exceptions=True)
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0], chunks

    return await asyncio.wait_for(both(), TIMEOUT_S)


def tokens(chunks: Sequence[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


async def drain(stream: AsyncIterator[TokenChunk]) -> list[TokenChunk]:
    """Every chunk of a decode stream (its error, if it fails)."""
    return [chunk async for chunk in stream]


async def worker_problems(workers: Sequence[EngineWorker]) -> list[str]:
    """What keeps `workers` from being idle: requests watched or queued, reservations, pending
    prompt tokens, blocks held, an inconsistent pool or worker (checked on each engine's
    thread, and by the worker's own `check_integrity`)."""
    problems = []
    for w in workers:
        load: WorkerLoad = await w.load()
        name = w.spec.worker_id
        if load.requests or load.reserved or load.reserved_blocks or load.pending_tokens:
            problems.append(f"{name}: {load.requests} watched, {load.reserved} reserved "
                            f"({load.reserved_blocks} blocks), {load.pending_tokens} prompt tokens pending")
        try:
            await w.check_integrity()
        except IntegrityError as e:
            problems.append(str(e))
        found = await w.on_engine(lambda w=w: idle_problems(w.engine))  # type: ignore[misc]
        problems += [f"{name}: {p}" for p in found]  # type: ignore[attr-defined]
    return problems


async def settled(workers: Sequence[EngineWorker], timeout_s: float = SETTLE_S) -> list[str]:
    """Problems left once `workers` had `timeout_s` to settle; [] when they are idle.

    The poll runs on a thread and asks the workers through this event loop, which stays free to
    run whatever the test left in flight (a backend's background cancels)."""
    loop = asyncio.get_running_loop()

    def idle() -> bool:
        return not asyncio.run_coroutine_threadsafe(worker_problems(workers), loop).result(timeout_s)

    if await asyncio.to_thread(poll, idle, timeout_s):
        return []
    return await worker_problems(workers)


# Fixtures of the worker tests (tests/conftest.py loads this module as a plugin): one pair per
# test module, idle around every test.


@pytest.fixture(scope="module")
def pair(smollm2_weights: LoadedWeights) -> Iterator[InProcessWorkers]:
    group = InProcessWorkers(cluster_config(), smollm2_weights)
    group.start(None)
    yield group
    group.stop()


@pytest.fixture
def workers(pair: InProcessWorkers) -> Iterator[InProcessWorkers]:
    """The module's pair, idle before the test; the test must leave it idle."""
    assert asyncio.run(settled([pair.prefill, pair.decode])) == []
    yield pair
    assert asyncio.run(settled([pair.prefill, pair.decode])) == [], "the test left a worker busy"
