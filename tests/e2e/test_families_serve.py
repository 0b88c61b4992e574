"""Every family through the serving paths, token-identical to transformers: the tiny random-weight
checkpoints of tests/model_families.py behind the co-located server (OpenAI HTTP API, the official
client) and behind the disaggregated 1P1D cluster (real prefill and decode workers in this
process, KV pushed layer by layer over loopback tcp, gRPC), and one family through the real
Ray 1P1D cluster (`ClusterBackend` with Ray actors, as `halfmoon serve` runs it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import openai
import pytest

from halfmoon.conductor.cluster import ClusterBackend
from halfmoon.conductor.colocated import ColocatedBackend
from halfmoon.conductor.cost_model import CostModel
from halfmoon.api.server import ServerConfig
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.engine.loader import load_weights
from halfmoon.v1 import generation_pb2 as pb
from halfmoon.v1 import generation_pb2_grpc as pb_grpc
from halfmoon.kvpool.redis_server import EmbeddedRedis
from tests.conductor.conftest import CLIENT_SLOS_ONLY, run_api
from tests.conftest import NUM_THREADS
from tests.e2e.support import cost_model_file, generate_all
from tests.model_families import BY_NAME, CASES, NEW, FamilyCase, build_checkpoint, hf_greedy, prompts
from tests.workers_support import InProcessWorkers, cluster_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


class Served:
    def __init__(self, case: FamilyCase, folder: Path) -> None:
        self.case, self.folder = case, folder
        model = build_checkpoint(case, folder)
        self.prompts = prompts(2)
        self.expected = [hf_greedy(model, p) for p in self.prompts]


@pytest.fixture(scope="module", params=CASES, ids=str)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Served:
    return Served(request.param, tmp_path_factory.mktemp("served") / request.param.name)


@pytest.fixture(scope="module")
def cost(tmp_path_factory: pytest.TempPathFactory) -> str:
    return cost_model_file(tmp_path_factory.mktemp("cost") / "cost.json")


def test_colocated_server_is_token_identical(served: Served, cost: str) -> None:
    engine = Engine(EngineConfig(model=str(served.folder), num_blocks=64, num_threads=NUM_THREADS,
                                 max_num_batched_tokens=32))
    backend = ColocatedBackend(engine, served.case.name, admission=CLIENT_SLOS_ONLY,
                               cost_model=CostModel.load(cost))
    api = run_api(backend, ServerConfig(grpc_port=0, http_port=0))
    try:
        assert generate_all(api.grpc_target, served.prompts, [NEW] * len(served.prompts)) == served.expected
        client = openai.OpenAI(base_url=api.http_url + "/v1", api_key="none", max_retries=0)
        models = client.models.list().data
        assert [m.id for m in models] == [served.case.name]
        assert models[0].model_extra["architecture"] == served.case.name.split("-")[0]
        out = client.completions.create(model=served.case.name, prompt=served.prompts[0], max_tokens=NEW,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == NEW and out.choices[0].finish_reason == "length"
        assert out.choices[0].text == grpc_text(api.grpc_target, served.prompts[0])
    finally:
        api.stop()


def test_1p1d_cluster_is_token_identical(served: Served, cost: str) -> None:
    config = cluster_config(cost_model=cost, max_num_batched_tokens=32)
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, model=str(served.folder)))
    workers = InProcessWorkers(config, load_weights(str(served.folder)))
    backend = ClusterBackend(config, redis_url=None, workers=workers, admission=CLIENT_SLOS_ONLY)
    api = run_api(backend, ServerConfig(grpc_port=0, http_port=0))
    try:
        assert backend.model.architecture == served.case.name.split("-")[0]
        got = generate_all(api.grpc_target, served.prompts, [NEW] * len(served.prompts))
        assert got == served.expected
    finally:
        api.stop()


@pytest.mark.parametrize("name", ["gemma3", "qwen2", "llama-dynamic-rope"])
def test_ray_1p1d_cluster_is_token_identical(name: str, tmp_path: Path, redis: EmbeddedRedis) -> None:
    """Through Ray actors, as `halfmoon serve` runs the cluster (KV between worker processes):
    Gemma 3 (local/global layers, windows cut in transit), Qwen2 (biases, yarn, sliding layers),
    Llama with dynamic NTK (RoPE lengths agreed by both sides)."""
    from halfmoon.conductor.cluster_config import ClusterConfig  # noqa: PLC0415
    from halfmoon.transport.config import TransportConfig  # noqa: PLC0415

    case = BY_NAME[name]
    model = build_checkpoint(case, tmp_path / "gemma3")
    ids = prompts(2)
    expected = [hf_greedy(model, p) for p in ids]
    config = ClusterConfig(prefill=1, decode=1, engine=EngineConfig(model=str(tmp_path / "gemma3"), num_blocks=64,
                                                                    max_num_batched_tokens=32),
                           transport=TransportConfig(backend="tcp", timeout_s=20.0), worker_threads=1,
                           object_store_mb=128, cost_model=cost_model_file(tmp_path / "cost.json"),
                           request_timeout_s=60.0, model_id=name)
    api = run_api(ClusterBackend(config, redis.url, admission=CLIENT_SLOS_ONLY), ServerConfig(grpc_port=0, http_port=0))
    try:
        assert generate_all(api.grpc_target, ids, [NEW] * len(ids)) == expected
    finally:
        api.stop()


def grpc_text(target: str, prompt_ids: list[int]) -> str:
    with grpc.insecure_channel(target) as channel:
        req = pb.GenerateRequest(prompt_token_ids=prompt_ids, max_tokens=NEW, ignore_eos=True)
        return "".join(r.text for r in pb_grpc.GenerationStub(channel).Generate(req, timeout=120))
