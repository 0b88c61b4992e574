"""The Conductor's request path over real workers in this process: `ClusterBackend` with an
`InProcessWorkers` group instead of Ray (no Redis index, the hand-written test cost model).

The backend lives on one event loop for the module (its health checks are a task of that loop);
each test runs its coroutine there, bounded by a timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any, NamedTuple, TypeVar

import pytest

from halfmoon.conductor.backend import GenerationInput, Slo
from halfmoon.conductor.cluster import ClusterBackend
from halfmoon.conductor.errors import SloMissError
from halfmoon.core.errors import InvalidRequestError
from halfmoon.core.messages import TokenChunk, WorkerLoad
from halfmoon.core.params import Constraint, FinishReason, SamplingParams
from halfmoon.engine.engine import Engine
from halfmoon.engine.loader import LoadedWeights
from tests.e2e.support import cost_model_file
from tests.engine.constraint_cases import PROMPTS, all_cases, check
from tests.workers_support import TIMEOUT_S, InProcessWorkers, cluster_config, settled, tokens

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

T = TypeVar("T")


class Running(NamedTuple):
    loop: asyncio.AbstractEventLoop
    backend: ClusterBackend
    workers: InProcessWorkers

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = TIMEOUT_S) -> T:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout_s))

    def settled(self) -> list[str]:
        """Problems left once the workers and the backend had a while to settle."""
        problems = self.run(settled([self.workers.prefill, self.workers.decode]))
        stats = self.backend.stats()
        tracked = stats.requests_running + stats.requests_waiting
        if tracked:
            problems.append(f"the backend still tracks {tracked} requests")
        return problems


@pytest.fixture(scope="module")
def cluster(smollm2_weights: LoadedWeights, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    config = cluster_config(cost_model=cost_model_file(tmp_path_factory.mktemp("cost") / "cost.json"))
    workers = InProcessWorkers(config, smollm2_weights)
    backend = ClusterBackend(config, redis_url=None, workers=workers)
    loop = asyncio.new_event_loop()
    running = Running(loop, backend, workers)
    try:
        running.run(backend.start(), timeout_s=120)
        yield running
    finally:
        running.run(backend.stop())
        loop.close()


@pytest.fixture
def idle(cluster: Running) -> Iterator[Running]:
    """The module's cluster, idle before the test; the test must leave it idle."""
    assert cluster.settled() == []
    yield cluster
    assert cluster.settled() == [], "the test left the cluster busy"


def test_a_request_through_the_conductor_is_one_engine_s(idle: Running, engine: Engine) -> None:
    prompt = engine.tokenizer.encode("The capital of France is")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = engine.generate([prompt], params)[0].output_ids

    async def collect() -> list[TokenChunk]:
        stream = idle.backend.generate(GenerationInput(prompt, params, request_id="through"))
        return [c async for c in stream]

    chunks = idle.run(collect())

    assert tokens(chunks) == expected
    assert all(c.request_id == "through" for c in chunks)
    end = chunks[-1].end
    assert end is not None and end.finish_reason is FinishReason.LENGTH
    assert (end.usage.prompt_tokens, end.usage.completion_tokens) == (len(prompt), params.max_tokens)
    assert end.timings.ttft_ms > 0 and end.timings.e2e_ms >= end.timings.ttft_ms


def test_closing_the_stream_early_leaves_both_workers_idle(idle: Running, engine: Engine) -> None:
    """A client gone after two chunks: the backend cancels the decode side and aborts the
    prefill; the `idle` fixture checks every block came back."""
    prompt = engine.tokenizer.encode("Write a short poem about the sea.")
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    async def two_then_close() -> list[TokenChunk]:
        stream = idle.backend.generate(GenerationInput(prompt, params, request_id="gone"))
        chunks = [await anext(stream), await anext(stream)]
        await stream.aclose()  # type: ignore[attr-defined]
        return chunks

    chunks = idle.run(two_then_close())

    assert [c.finished for c in chunks] == [False, False]


def test_an_id_is_refused_while_it_runs_and_reused_at_once_after_a_cancel(idle: Running, engine: Engine) -> None:
    """The workers free a cancelled request a step later; its id is the client's again at once
    (the workers know each try as `{id}@{n}`) and a second request under it runs exactly."""
    prompt = engine.tokenizer.encode("Write a short poem about the sea.")
    long, short = SamplingParams(max_tokens=60, ignore_eos=True), SamplingParams(max_tokens=6, ignore_eos=True)
    want = engine.generate([prompt], short)[0].output_ids

    async def cancel_then_reuse() -> tuple[str, list[TokenChunk]]:
        first = idle.backend.generate(GenerationInput(prompt, long, request_id="again"))
        await anext(first)
        with pytest.raises(InvalidRequestError) as refused:
            await anext(idle.backend.generate(GenerationInput(prompt, short, request_id="again")))
        await first.aclose()  # type: ignore[attr-defined]
        return str(refused.value), [c async for c in idle.backend.generate(GenerationInput(prompt, short,
                                                                                           request_id="again"))]

    refused, chunks = idle.run(cancel_then_reuse())

    assert "'again' is already in use" in refused
    assert tokens(chunks) == want and {c.request_id for c in chunks} == {"again"}
    assert chunks[-1].end is not None and chunks[-1].end.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("name, constraint", all_cases(), ids=[n for n, _ in all_cases()])
def test_constrained_choices_over_prefill_and_decode_equal_the_engine_s(idle: Running, engine: Engine, name: str,
                                                                        constraint: Constraint) -> None:
    """The prefill worker masks every choice's first token, the decode worker the rest, each
    matcher caught up from the token history: the same tokens as one co-located engine, and
    every choice that stops satisfies its constraint."""
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPTS[name]}]))
    params = SamplingParams(max_tokens=80, temperature=0.9, seed=21, n=3, constraint=constraint)
    expected = engine.generate_choices(prompt, params)

    async def collect() -> list[TokenChunk]:
        return [c async for c in idle.backend.generate(GenerationInput(prompt, params, request_id="shaped"))]

    chunks = idle.run(collect())

    got = [[t for c in chunks if c.index == i for t in c.token_ids] for i in range(3)]
    assert got == [r.output_ids for r in expected]
    for result in expected:
        if result.finish_reason is FinishReason.STOP:
            check(name, result.text)


def test_a_request_that_cannot_meet_its_slo_is_refused_before_any_worker_works(idle: Running) -> None:
    p, d = idle.workers.prefill, idle.workers.decode
    inp = GenerationInput([1, 2, 3, 4], SamplingParams(max_tokens=4), slo=Slo(ttft_ms=0.001))

    async def loads() -> tuple[WorkerLoad, WorkerLoad]:
        return await p.load(), await d.load()

    async def first() -> TokenChunk:
        return await anext(idle.backend.generate(inp))

    before = idle.run(loads())
    with pytest.raises(SloMissError, match="TTFT"):
        idle.run(first())
    after = idle.run(loads())

    assert [(w.steps, w.free_blocks, w.reserved, w.prompt_tokens_computed) for w in after] == \
        [(w.steps, w.free_blocks, w.reserved, w.prompt_tokens_computed) for w in before]


def test_a_lora_adapter_runs_on_its_prefill_and_its_decode_worker(idle: Running, engine: Engine,
                                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    """1P1D through the Conductor: the adapter named at the door (the registry) is read by both
    workers, the tokens are the co-located engine's under the same adapter, not the base model's;
    the workers then report holding it, so the router no longer prices reading it."""
    from halfmoon.bench.lora_bench import write_adapter
    from halfmoon.core.adapters import AdapterRef, InvalidAdapterError

    folder = write_adapter(tmp_path_factory.mktemp("lora") / "tuned", engine.info().lora, rank=8, seed=3)
    info = idle.backend.adapters.load("tuned", str(folder))
    idle.run(idle.backend.prepare_adapter(info.ref))  # as the admin API does: every worker reads it now
    for worker in (idle.workers.prefill, idle.workers.decode):
        assert worker.engine.lora is not None and worker.engine.lora.stats.disk_loads == 1
    prompt = engine.tokenizer.encode("The capital of France is")
    params = SamplingParams(max_tokens=12, ignore_eos=True, adapter=info.ref)
    expected = engine.generate([prompt], params)[0].output_ids
    assert expected != engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].output_ids

    async def collect() -> list[int]:
        out: list[int] = []
        async for chunk in idle.backend.generate(GenerationInput(prompt, params, request_id="lora")):
            out += chunk.token_ids
        return out

    assert idle.run(collect()) == expected
    for worker in (idle.workers.prefill, idle.workers.decode):
        assert worker.engine.lora is not None and worker.engine.lora.stats.requests == {"tuned": 1}
    idle.run(idle.backend.manager.check_health())
    assert idle.backend.prefix_match(prompt, None, info.ref).adapter_ms == {}  # the prefill worker holds it
    idle.backend.adapters.unload("tuned")
    missing = AdapterRef("gone", str(tmp_path_factory.mktemp("lora-gone") / "nowhere"), "0" * 32)
    with pytest.raises(InvalidAdapterError, match=r"worker (prefill|decode)-0: .* is not a folder"):
        idle.run(idle.backend.prepare_adapter(missing))  # a path no worker can read is refused, named
