"""The planner's advisor (conductor/planner.py's `Advisor`): the last window's requests replayed
through each candidate split by the simulator, the same replay as the sizing page's sweep.

    SimAdvisor(base, cost).score(window, window_s, splits) -> {split: goodput req/s}

The window is what the Conductor saw (arrival, prompt length, output length: the tokens a
finished request generated, else the max_tokens it asked for). Live prompts carry no trace
hash ids, so the replay shares no prefix between them: a cache hit the live cluster had is
a full prefill here (the advice is conservative for prefix-heavy traffic; docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import TYPE_CHECKING

from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.planner import Seen, Split
from halfmoon.sim.cluster import SimConfig, SimResult, simulate
from halfmoon.sim.report import met, objectives
from halfmoon.sim.trace import HASH_BLOCK_TOKENS, TraceRequest
from halfmoon.sim.workload import Workload, build

if TYPE_CHECKING:  # the child process imports this module: nothing of the engine (no torch)
    from halfmoon.conductor.cluster import ClusterBackend
    from halfmoon.core.messages import EngineInfo

MAX_REQUESTS = 600  # per replay: ~1 s of simulation per split on one core
NICE = 10  # the child advisor's niceness: serving first


class SimAdvisor:
    """Scores splits by simulating the window on `base` (its shape replaced per split).

    Two economies keep a tick cheap enough to run beside serving: the replay holds at most
    `max_requests` (the most recent; the window shrinks to their span, goodput stays per
    second), and it decides each request once (no second looks: the advice is about
    capacity, a second look moves a few requests within one split)."""

    def __init__(self, base: SimConfig, cost: CostModel, max_requests: int = MAX_REQUESTS) -> None:
        self.base = dataclasses.replace(base, admission=dataclasses.replace(base.admission, second_look=False))
        self.cost = cost
        self.max_requests = max_requests
        self.replays = 0  # simulations run (the dashboard and tests read it)

    def score(self, window: Sequence[Seen], window_s: float, splits: Sequence[Split]) -> dict[Split, float]:
        window, window_s = recent(window, window_s, self.max_requests)
        workload = window_workload(window, window_s)
        scores = {}
        for split in splits:
            config = dataclasses.replace(self.base, prefill=split.prefill, decode=split.decode, colocated=False)
            scores[split] = goodput(simulate(workload, config, self.cost), window_s)
            self.replays += 1
        return scores


class ChildAdvisor:
    """A `SimAdvisor` in a child process at low priority (the Conductor's: serving keeps its
    CPU and the GIL); `score` blocks its caller's thread until the child answers."""

    def __init__(self, base: SimConfig, cost: CostModel, max_requests: int = MAX_REQUESTS) -> None:
        self.advisor = SimAdvisor(base, cost, max_requests)
        self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_lower)

    def score(self, window: Sequence[Seen], window_s: float, splits: Sequence[Split]) -> dict[Split, float]:
        scores = self._pool.submit(self.advisor.score, list(window), window_s, list(splits)).result()
        self.advisor.replays += len(splits)
        return scores

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def live_advisor(backend: ClusterBackend) -> ChildAdvisor:
    """The Conductor's advisor: its cluster's engines, ledgers and admission as a SimConfig,
    priced by the cost model it admits with (`ClusterBackend(advisor=live_advisor)`)."""
    assert backend.cost is not None, "started backends only"
    return ChildAdvisor(live_config(backend), backend.cost)


def live_config(backend: ClusterBackend) -> SimConfig:
    """The running cluster as the simulator's config: each decode worker's KV, the engines'
    block, chunk and batch, the prefill workers' prompt slots, the admission in force."""
    config = backend.config
    device = backend.kv_capacity_tokens or SimConfig().device_tokens
    return SimConfig(prefill=config.prefill, decode=config.decode, device_tokens=device,
                     block_size=backend.block_size, chunk=config.engine.max_num_batched_tokens,
                     max_seqs=config.engine.max_num_seqs, prefill_max_seqs=config.prefill_max_seqs,
                     admission=backend.admission_config, cores=shared_cores(backend.worker_infos))


def shared_cores(infos: Sequence[EngineInfo]) -> float | None:
    """The workers at full speed at once when CPU workers share their hosts' cores (SimConfig's
    `cores`): per host, its cores over a worker's threads, at most its workers; None when every
    worker has its own compute (a GPU each, or enough cores on every host)."""
    if not infos or any(i.device != "cpu" or i.cores < 1 for i in infos):
        return None
    hosts: dict[str, list[EngineInfo]] = {}
    for info in infos:
        hosts.setdefault(info.host, []).append(info)
    full = sum(min(float(len(on)), max(i.cores for i in on) / max(1, max(i.threads for i in on)))
               for on in hosts.values())
    return None if full >= len(infos) else full


def _lower() -> None:
    os.nice(NICE)


def recent(window: Sequence[Seen], window_s: float, most: int) -> tuple[Sequence[Seen], float]:
    """The last `most` requests of the window and the span they arrived over."""
    if len(window) <= most:
        return window, window_s
    kept = sorted(window, key=lambda s: s.arrival)[-most:]
    return kept, max(kept[-1].arrival - kept[0].arrival, 1e-3)


def window_workload(window: Sequence[Seen], window_s: float) -> Workload:
    """The window as a workload arriving over [0, window_s] (its last arrival at the end at
    the latest), every prompt's blocks its own."""
    if not window:
        return Workload((), window_s, "planner window")
    start = max(s.arrival for s in window) - window_s
    ids = itertools.count()
    trace = [TraceRequest(n, max(0.0, s.arrival - start) * 1e3, s.prompt_len, s.output_len,
                          tuple(next(ids) for _ in range(-(-s.prompt_len // HASH_BLOCK_TOKENS))))
             for n, s in enumerate(sorted(window, key=lambda s: s.arrival), start=1)]
    return dataclasses.replace(build(trace, source="planner window"), duration_s=window_s)


def goodput(result: SimResult, window_s: float) -> float:
    """Requests/s that met both objectives of the default class."""
    ttft_ms, tbt_ms = objectives(result)
    return sum(met(r, ttft_ms, tbt_ms) for r in result.records) / window_s
