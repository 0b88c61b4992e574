"""Tensor-parallel workers in the cluster (issue 35): the Conductor's request path over a 1P1D
pair whose prefill and decode workers have different tensor-parallel layouts (prefill TP=2 ->
decode TP=1, and TP=1 -> TP=2): real workers in this process, their follower ranks real
processes over gloo, the KV over loopback tcp between every (prefill rank, decode rank) pair.

Greedy output must be token-identical to one process (the session's TP=1 engine, fp32); each
decode rank's receiver must have verified exactly its KV heads' bytes of every prompt block, and
every worker's integrity check passes after.
"""

from __future__ import annotations

import asyncio

import pytest

from halfmoon.conductor.backend import GenerationInput
from halfmoon.conductor.cluster import ClusterBackend
from halfmoon.conductor.cost_model import CostModel
from halfmoon.core.blocks import cdiv
from halfmoon.core.params import SamplingParams
from halfmoon.engine.engine import Engine
from halfmoon.engine.loader import LoadedWeights
from tests.e2e.support import cost_model_file
from tests.workers_support import TIMEOUT_S, InProcessWorkers, cluster_config, settled, tokens
from halfmoon.transport.heads import kv_head_range

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = ["The capital of France is", "Write a haiku about the sea. " * 6,
           "In 1969, the first humans", "def fibonacci(n):\n    " * 4]


@pytest.fixture(params=[(2, 1), (1, 2)], ids=["prefill-tp2-decode-tp1", "prefill-tp1-decode-tp2"])
def layouts(request: pytest.FixtureRequest) -> tuple[int, int]:
    return request.param


def test_kv_between_layouts_is_token_identical_and_each_decode_rank_gets_its_heads(
        layouts: tuple[int, int], smollm2_weights: LoadedWeights, engine: Engine,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    p, d = layouts
    config = cluster_config(cost_model=cost_model_file(tmp_path_factory.mktemp("cost") / "cost.json"),
                            prefill_tp=p, decode_tp=d)
    workers = InProcessWorkers(config, smollm2_weights)
    backend = ClusterBackend(config, redis_url=None, workers=workers)
    loop = asyncio.new_event_loop()

    def run(coro, timeout_s: float = TIMEOUT_S):  # noqa: ANN001, ANN202
        return loop.run_until_complete(asyncio.wait_for(coro, timeout_s))

    prompts = [engine.tokenizer.encode(t) for t in PROMPTS]
    lengths = [4 + 5 * i for i in range(len(prompts))]

    async def one(i: int) -> list[int]:
        params = SamplingParams(max_tokens=lengths[i], ignore_eos=True)
        stream = backend.generate(GenerationInput(prompts[i], params, request_id=f"tp-{i}"))
        return tokens([c async for c in stream])

    async def all_at_once() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))

    try:
        run(backend.start(), timeout_s=180)
        got = run(all_at_once(), timeout_s=180)
        for i, ids in enumerate(prompts):
            expected = engine.generate([ids], SamplingParams(max_tokens=lengths[i], ignore_eos=True))[0].output_ids
            assert got[i] == expected, f"prompt {i}: tp {p} -> {d} differs from one process"
        assert run(settled([workers.prefill, workers.decode])) == []
        load = run(workers.decode.load())
        cfg = engine.model_config
        per_head = sum(cdiv(len(ids), 16) for ids in prompts) * cfg.num_layers * 2 * 16 * cfg.head_dim * 4
        heads = [kv_head_range(cfg.num_kv_heads, r, d) for r in range(d)]
        assert load.tp == d and run(workers.prefill.load()).tp == p
        assert load.kv_rank_bytes == tuple((b - a) * per_head for a, b in heads), "each rank: its heads' bytes only"
    finally:
        run(backend.stop(), timeout_s=60)
        loop.close()


def test_with_decode_workers_of_another_size_the_conductor_routes_on_both_profiles(
        smollm2_weights: LoadedWeights, tmp_path_factory: pytest.TempPathFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No cost model given, prefill TP=1 and decode TP=2: the Conductor profiles a worker of each
    (cached under its own shape) and takes prefill from one, decode steps from the other."""
    cache = tmp_path_factory.mktemp("profiles")
    monkeypatch.setenv("HALFMOON_CACHE_DIR", str(cache))
    config = cluster_config(prefill_tp=1, decode_tp=2)
    workers = InProcessWorkers(config, smollm2_weights)
    backend = ClusterBackend(config, redis_url=None, workers=workers)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(asyncio.wait_for(backend.start(), 300))
        profiles = [CostModel.load(p) for p in sorted((cache / "profiles").glob("*.json"))]
        assert len(profiles) == 2, "one profile per worker shape"
        (tp2,) = [p for p in profiles if p.decode_coef == backend.cost.decode_coef]
        (tp1,) = [p for p in profiles if p is not tp2]
        assert backend.cost.prefill_coef == tp1.prefill_coef and tp1.decode_coef != tp2.decode_coef
    finally:
        loop.run_until_complete(asyncio.wait_for(backend.stop(), 60))
        loop.close()
