"""Speculative decoding through the serving paths: the co-located server and the 1P1D cluster
(real prefill and decode workers in this process, KV over loopback tcp), with both draft sources
(`ngram`, and `draft:` a tiny random-weight model over SmolLM2's vocabulary), give the greedy
tokens of one engine without speculation; the decode worker reports what it drafted and accepted
(`/metrics`), and a request can opt out."""

from __future__ import annotations

import dataclasses
import urllib.request
from pathlib import Path

import pytest

from halfmoon.conductor.cluster import ClusterBackend
from halfmoon.conductor.colocated import ColocatedBackend
from halfmoon.conductor.cost_model import CostModel
from halfmoon.api.server import ServerConfig
from halfmoon.core.params import SamplingParams
from halfmoon.engine.engine import Engine
from halfmoon.engine.loader import LoadedWeights
from tests.conductor.conftest import CLIENT_SLOS_ONLY, run_api
from tests.conftest import EngineFactory
from tests.e2e.support import cost_model_file, generate_all
from tests.model_families import BY_NAME, build_checkpoint
from tests.workers_support import InProcessWorkers, cluster_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
QUOTING = ("Repeat this sentence exactly, twice: The committee approved the budget for the new library "
           "on Tuesday evening after a long debate.\nAnswer:")
OTHERS = ("def fibonacci(n):", "The capital of France is", "List the planets of the solar system in order:")
NEW = 40


@pytest.fixture(scope="module", params=["ngram", "draft"])
def source(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The `speculative` setting: prompt lookup, or a tiny random-weight draft model with the
    target's vocabulary (it rarely agrees: verification must still change nothing)."""
    if request.param == "ngram":
        return "ngram"
    tiny = dataclasses.replace(BY_NAME["llama"], kwargs={**BY_NAME["llama"].kwargs, "vocab_size": 49152})
    folder = tmp_path_factory.mktemp("draft") / "tiny"
    build_checkpoint(tiny, folder)
    return f"draft:{folder}"


def drafted(counts: dict[str, float], source: str) -> bool:
    """The worker drafted and verified: n-gram drafts of the quoting prompt get accepted; a random
    draft model's are proposed (and mostly rejected)."""
    return counts.get("accepted" if source == "ngram" else "proposed", 0) > 0


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
                                                              expected: list[list[int]], source: str,
                                                              tmp_path: Path) -> None:
    engine = make_engine(num_blocks=256, speculative=source)
    backend = ColocatedBackend(engine, "smollm2", admission=CLIENT_SLOS_ONLY,
                               cost_model=CostModel.load(cost_model_file(tmp_path / "cost.json")))
    api = run_api(backend, ServerConfig(grpc_port=0, http_port=0))
    try:
        assert generate_all(api.grpc_target, prompts, [NEW] * len(prompts)) == expected
        counts = speculation_metrics(api.http_url)
        assert drafted(counts, source) and counts["emitted"] > counts.get("accepted", 0)
        assert engine.speculator is not None and engine.speculator.stats.accepted == counts.get("accepted", 0)
    finally:
        api.stop()
    engine.pool.check_integrity()


def test_1p1d_cluster_with_speculation_is_token_identical(smollm2_weights: LoadedWeights, prompts: list[list[int]],
                                                          expected: list[list[int]], source: str,
                                                          tmp_path: Path) -> None:
    config = cluster_config(cost_model=cost_model_file(tmp_path / "cost.json"), num_blocks=256)
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, speculative=source))
    workers = InProcessWorkers(config, smollm2_weights)
    backend = ClusterBackend(config, redis_url=None, workers=workers, admission=CLIENT_SLOS_ONLY)
    api = run_api(backend, ServerConfig(grpc_port=0, http_port=0))
    try:
        assert generate_all(api.grpc_target, prompts, [NEW] * len(prompts)) == expected
        counts = speculation_metrics(api.http_url)
        assert drafted(counts, source)  # the decode worker drafted and verified
    finally:
        api.stop()
