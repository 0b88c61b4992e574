"""Speculative decoding through the serving paths: the co-located server and the 1P1D cluster
(real prefill and decode workers in this process, KV over loopback tcp) with `speculative=ngram`
give the greedy tokens of one engine without speculation; the decode worker reports what it
drafted and accepted (`/metrics`), and a request can opt out."""

from __future__ import annotations

import dataclasses
import urllib.request
from pathlib import Path

import pytest

from conductor.cluster import ClusterBackend
from conductor.colocated import ColocatedBackend
from conductor.cost_model import CostModel
from conductor.server import ServerConfig
from core.params import SamplingParams
from engine.engine import Engine
from engine.loader import LoadedWeights
from tests.conductor.conftest import CLIENT_SLOS_ONLY, run_api
from tests.conftest import EngineFactory
from tests.e2e.support import cost_model_file, generate_all
from tests.workers_support import InProcessWorkers, cluster_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
QUOTING = ("Repeat this sentence exactly, twice: The committee approved the budget for the new library "
           "on Tuesday evening after a long debate.\nAnswer:")
OTHERS = ("def fibonacci(n):", "The capital of France is", "List the planets of the solar system in order:")
NEW = 40


@pytest.fixture(scope="module")
def prompts(shared_engine: Engine) -> list[list[int]]:
    return [shared_engine.tokenizer.encode(t) for t in (QUOTING, *OTHERS)]


@pytest.fixture(scope="module")
def expected(shared_engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    return [r.output_ids for r in shared_engine.generate(prompts, params)]


def speculation_metrics(http_url: str) -> dict[str, float]:
    with urllib.request.urlopen(http_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("halfmoon_worker_speculative_tokens_total{"):
            kind = line.split('kind="')[1].split('"')[0]
            out[kind] = out.get(kind, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_colocated_server_with_speculation_is_token_identical(make_engine: EngineFactory, prompts: list[list[int]],
                                                              expected: list[list[int]], tmp_path: Path) -> None:
    engine = make_engine(num_blocks=256, speculative="ngram")
    backend = ColocatedBackend(engine, "smollm2", admission=CLIENT_SLOS_ONLY,
                               cost_model=CostModel.load(cost_model_file(tmp_path / "cost.json")))
    api = run_api(backend, ServerConfig(grpc_port=0, http_port=0))
    try:
        assert generate_all(api.grpc_target, prompts, [NEW] * len(prompts)) == expected
        counts = speculation_metrics(api.http_url)
        assert counts.get("accepted", 0) > 0 and counts["emitted"] > counts["accepted"]
        assert engine.speculator is not None and engine.speculator.stats.accepted == counts["accepted"]
    finally:
        api.stop()
    engine.pool.check_integrity()


def test_1p1d_cluster_with_speculation_is_token_identical(smollm2_weights: LoadedWeights, prompts: list[list[int]],
                                                          expected: list[list[int]], tmp_path: Path) -> None:
    config = cluster_config(cost_model=cost_model_file(tmp_path / "cost.json"), num_blocks=256)
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, speculative="ngram"))
    workers = InProcessWorkers(config, smollm2_weights)
    backend = ClusterBackend(config, redis_url=None, workers=workers, admission=CLIENT_SLOS_ONLY)
    api = run_api(backend, ServerConfig(grpc_port=0, http_port=0))
    try:
        assert generate_all(api.grpc_target, prompts, [NEW] * len(prompts)) == expected
        counts = speculation_metrics(api.http_url)
        assert counts.get("accepted", 0) > 0  # the decode worker drafted and verified
    finally:
        api.stop()
