"""Shared by the end-to-end tests: a real cluster started in this process, real servers started
as processes, and the reference outputs they are compared with."""

from __future__ import annotations

import re
import subprocess
import threading
from pathlib import Path

import grpc
import pytest

from halfmoon.conductor.cluster import ClusterBackend
from halfmoon.conductor.planner_loop import AdvisorFactory
from halfmoon.conductor.cluster_config import ClusterConfig
from halfmoon.core.messages import WorkerLoad
from halfmoon.core.tracing import TracingConfig
from halfmoon.conductor.cost_model import DECODE_TERMS, PREFILL_TERMS, CostModel
from halfmoon.api.server import ServerConfig
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.core.params import SamplingParams
from halfmoon.v1 import generation_pb2 as pb
from halfmoon.v1 import generation_pb2_grpc as pb_grpc
from halfmoon.kvpool.redis_server import EmbeddedRedis
from tests.conductor.conftest import CLIENT_SLOS_ONLY, RunningApi, run_api
from tests.waiting import poll
from halfmoon.transport.config import TransportConfig

# A cost model shaped like SmolLM2 fp32 on one core (~550 prompt tok/s, ~45 ms per decode step),
# written by hand so the tests need no profiling run; routing only needs its proportions.
COEF_PREFILL = {"1": 5.0, "n": 1.8, "n*c": 0.0, "n^2": 0.0002}
COEF_DECODE = {"1": 40.0, "b": 4.0, "k": 0.002}


def cost_model_file(path: Path) -> str:
    model = CostModel(tuple(COEF_PREFILL[t] for t in PREFILL_TERMS), tuple(COEF_DECODE[t] for t in DECODE_TERMS),
                      transfer_bytes_per_s=1.0e9, kv_bytes_per_token=30 * 2 * 3 * 64 * 4, source="tests")
    model.save(path)
    return str(path)


def start_cluster(tmp: Path, prefill: int, decode: int, redis: EmbeddedRedis | None,
                  kv_transport: str = "tcp", tracing: TracingConfig | None = None, standby: int = 0,
                  advisor: AdvisorFactory | None = None, **cluster: object) -> RunningApi:
    """`redis` None: no block index; `cluster`: more `ClusterConfig` fields (e.g. decode_tp,
    planner: then `advisor` makes its advisor)."""
    config = ClusterConfig(prefill=prefill, decode=decode, **cluster,  # type: ignore[arg-type]
                           engine=EngineConfig(num_blocks=256, max_num_batched_tokens=256),
                           transport=TransportConfig(backend=kv_transport, timeout_s=20.0), worker_threads=1,
                           object_store_mb=128, cost_model=cost_model_file(tmp / "cost.json"),
                           request_timeout_s=30.0, tracing=tracing or TracingConfig(), standby=standby)
    # Admission on the objectives a request sends only: these tests are about the request path.
    return run_api(ClusterBackend(config, redis.url if redis is not None else None, admission=CLIENT_SLOS_ONLY,
                                  advisor=advisor), ServerConfig(grpc_port=0, http_port=0))


def prompts(engine: Engine) -> list[list[int]]:
    """16 prompts of mixed lengths (5 .. ~300 tokens): chunked prefills, partial last blocks."""
    tok = engine.tokenizer
    base = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
            "List the planets of the solar system in order from the sun:"]
    out = []
    for i in range(16):
        text = base[i % 4] + (" Please explain in detail." * (i * 3) if i % 3 else "")
        out.append(tok.encode(text))
    return out


def generate_all(target: str, prompt_ids: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """All requests at once (16 concurrent streams); token ids per request."""
    results: list[list[int] | BaseException] = [[] for _ in prompt_ids]

    def one(i: int) -> None:
        try:
            with grpc.insecure_channel(target) as channel:
                req = pb.GenerateRequest(prompt_token_ids=prompt_ids[i], max_tokens=max_tokens[i], ignore_eos=True)
                results[i] = [t for r in pb_grpc.GenerationStub(channel).Generate(req, timeout=300)
                              for t in r.token_ids]
        except BaseException as e:  # reported below
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompt_ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(400)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    return results  # type: ignore[return-value]


def reference(engine: Engine, prompt_ids: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    return [r.output_ids for r in engine.generate(prompt_ids, params)]


def worker_load(api: RunningApi, worker_id: str) -> WorkerLoad:
    import ray

    return ray.get(api.backend.manager.workers[worker_id].api.handle.load.remote(), timeout=30)


def wait_for_log(proc: subprocess.Popen[str], log: Path, pattern: str, timeout: float = 300) -> re.Match[str]:
    """The first match of `pattern` in a server's log; fails the test if it exits or times out."""

    def seen() -> re.Match[str] | None:
        match = re.search(pattern, log.read_text())
        if not match and proc.poll() is not None:
            pytest.fail(f"serve exited early ({proc.returncode}): {log.read_text()[-3000:]}")
        return match

    match = poll(seen, timeout, interval_s=0.2)
    if not match:
        pytest.fail(f"serve did not come up in {timeout}s: {log.read_text()[-3000:]}")
    return match
