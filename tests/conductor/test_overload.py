"""Overload end to end: a burst far above capacity, over HTTP, against the disaggregated request
path (real prefill and decode workers in this process, the real front door) and the co-located
engine, with the server's default admission (predictive, class SLOs). What must hold: every
request gets an answer (200 or 429 with Retry-After), never a 5xx, nothing hangs, and afterwards
every pool's integrity check passes with no reservation left."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from halfmoon.conductor.admission import AdmissionConfig
from halfmoon.conductor.cluster import ClusterBackend
from halfmoon.api.server import ServerConfig
from halfmoon.engine.loader import LoadedWeights
from tests.conductor.conftest import MODEL, RunningApi, run_api
from tests.e2e.support import cost_model_file
from tests.waiting import wait_until
from tests.workers_support import InProcessWorkers, cluster_config, settled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

BURST = 24  # requests sent at once; the cluster serves a few within the SLOs
# Tight enough that a burst this size cannot all fit, loose enough that the first ones do.
ADMISSION = AdmissionConfig(standard_ttft_ms=1500.0, standard_tbt_ms=400.0)


@pytest.fixture(scope="module")
def cluster_api(smollm2_weights: LoadedWeights, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[RunningApi, InProcessWorkers]]:
    config = cluster_config(cost_model=cost_model_file(tmp_path_factory.mktemp("cost") / "cost.json"))
    workers = InProcessWorkers(config, smollm2_weights)
    api = run_api(ClusterBackend(config, None, workers, admission=ADMISSION), ServerConfig(grpc_port=0, http_port=0))
    try:
        yield api, workers
    finally:
        api.stop()


async def burst(url: str, n: int) -> list[httpx.Response]:
    """`n` completions sent at once, each prompt distinct (no prefix cache shortcuts)."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        calls = [client.post("/v1/completions", json={
            "model": MODEL, "prompt": f"Request {i}: " + "tell me about the sea and the sky. " * 12,
            "max_tokens": 8, "ignore_eos": True}) for i in range(n)]
        return await asyncio.gather(*calls)


def check_answers(responses: list[httpx.Response]) -> Counter[int]:
    codes = Counter(r.status_code for r in responses)
    assert set(codes) <= {200, 429}, f"only 200 and 429 may answer load: {codes}"
    assert codes[200] >= 1 and codes[429] >= 1, f"a burst this size is partly served, partly rejected: {codes}"
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1
            error = r.json()["error"]
            assert error["type"] == "rate_limit_error" and error["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 8
    return codes


def test_a_burst_on_the_cluster_is_served_or_rejected_cleanly(cluster_api: tuple[RunningApi, InProcessWorkers]) -> None:
    api, workers = cluster_api
    responses = asyncio.run(asyncio.wait_for(burst(api.http_url, BURST), 180))
    check_answers(responses)
    backend = api.backend
    assert isinstance(backend, ClusterBackend)
    decisions = backend.admission_stats.decisions
    assert sum(n for (_, outcome, _), n in decisions.items() if outcome == "rejected") >= 1

    async def after() -> list[str]:
        problems = await settled([workers.prefill, workers.decode])
        for worker in (workers.prefill, workers.decode):
            report = await worker.check_integrity()
            if report.reservations or report.reserved_blocks:
                problems.append(f"{report.worker_id} still holds {report.reservations} reservations")
        return problems

    assert asyncio.run(asyncio.wait_for(after(), 60)) == []
    for w in backend.manager.workers.values():
        w.bound.check_integrity()
        assert (w.pending.depth, len(w.bound.jobs), w.bound.reserved_blocks) == (0, 0, 0), w.worker_id


def test_a_burst_on_the_colocated_engine_is_served_or_rejected_cleanly(start_api) -> None:
    api = start_api(admission=ADMISSION)
    responses = asyncio.run(asyncio.wait_for(burst(api.http_url, BURST), 180))
    check_answers(responses)
    backend = api.backend
    wait_until(lambda: not backend.engine.has_unfinished(), timeout_s=30, what="the engine drains")
    backend.engine.pool.check_integrity()
    backend.bound.check_integrity()
    assert (backend.pending.depth, len(backend.bound.jobs)) == (0, 0)
    assert math.isclose(backend.engine.pool.num_free(), backend.engine.pool.num_blocks)
