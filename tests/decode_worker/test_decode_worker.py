"""The decode worker driven directly, beside a real prefill worker: no Ray, no Conductor.

`reserve` hands out blocks and the receiver's address, `generate` waits for the KV and streams
`TokenChunk`s, `cancel` gives a reservation back wherever the request is. After every test both
workers are idle: nothing watched or reserved, every block free, pools consistent.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from core.messages import (DecodeTask, KVHandoff, KVTransferFailedError, EngineInfo, TokenChunk,
                           ReservationError, WorkerLoad)
from core.params import FinishReason, SamplingParams
from engine.engine import Engine
from engine.loader import LoadedWeights
from tests.workers_support import (TIMEOUT_S, InProcessWorkers, cluster_config, drain, run_pair,
                                   start_worker, tokens)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_generate_streams_the_prefilled_request_to_its_end(workers: InProcessWorkers,
                                                           engine: Engine) -> None:
    """The first chunk starts with the prefill worker's token; only the last chunk ends; the
    tokens are one engine's; the request's blocks stay behind as prefix cache (free)."""
    prompt = engine.tokenizer.encode("List the planets of the solar system in order from the sun:")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = engine.generate([prompt], params)[0].output_ids

    result, chunks = asyncio.run(run_pair(workers.prefill, workers.decode, "stream", prompt, params))

    assert chunks[0].token_ids[0] == result.first_token
    assert all(c.request_id == "stream" for c in chunks)
    assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert tokens(chunks) == expected
    end = chunks[-1].end
    assert end is not None and end.finish_reason is FinishReason.LENGTH
    assert (end.usage.prompt_tokens, end.usage.completion_tokens) == (len(prompt), params.max_tokens)
    assert "".join(c.text for c in chunks) == engine.tokenizer.decode(expected)


def test_reserve_opens_blocks_that_cancel_gives_back(workers: InProcessWorkers) -> None:
    d = workers.decode
    total = d.engine.pool.num_blocks

    async def run() -> tuple[list[int], WorkerLoad, WorkerLoad]:
        handoff = await d.reserve("held", 40)  # 40 tokens: 3 blocks of 16
        held = await d.load()
        await d.cancel("held")
        return handoff.block_ids, held, await d.load()

    block_ids, held, after = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))

    assert len(block_ids) == 3 and len(set(block_ids)) == 3
    assert (held.reserved, held.free_blocks) == (1, total - 3)
    assert (after.reserved, after.free_blocks) == (0, total)


def test_cancel_while_waiting_for_kv_returns_the_reservation(workers: InProcessWorkers) -> None:
    """No prefill ever comes: `generate` waits for the KV until `cancel` stops it; it raises,
    and the reserved blocks are free again."""
    d = workers.decode
    prompt = list(range(100, 150))
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def run() -> tuple[BaseException | list[TokenChunk], WorkerLoad]:
        await d.reserve("waiting", len(prompt))
        task = DecodeTask("waiting", prompt, params, None, TIMEOUT_S)
        stream = asyncio.ensure_future(drain(d.generate(task)))
        await d.cancel("waiting")
        outcome = (await asyncio.gather(stream, return_exceptions=True))[0]
        return outcome, await d.load()

    outcome, load = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))

    assert isinstance(outcome, KVTransferFailedError), outcome
    assert (load.reserved, load.requests, load.free_blocks) == (0, 0, load.total_blocks)


def test_generate_for_a_request_never_reserved_fails_at_once(workers: InProcessWorkers) -> None:
    d = workers.decode
    task = DecodeTask("unknown", [1, 2, 3], SamplingParams(max_tokens=2), None, TIMEOUT_S)

    with pytest.raises(KVTransferFailedError, match="unknown"):
        asyncio.run(asyncio.wait_for(drain(d.generate(task)), TIMEOUT_S))


def test_model_info_and_load_describe_the_engine(workers: InProcessWorkers) -> None:
    d = workers.decode

    async def ask() -> tuple[EngineInfo, EngineInfo, WorkerLoad]:
        return await d.engine_info(), await workers.prefill.engine_info(), await d.load()

    info, prefill_info, load = asyncio.run(ask())

    e = d.engine
    assert info == prefill_info  # the Conductor asks one worker and sizes requests for all
    assert (info.block_size, info.vocab_size, info.dtype) == (16, e.model_config.vocab_size, "float32")
    assert load.alive and load.failure is None
    assert (load.free_blocks, load.total_blocks) == (e.pool.num_blocks, e.pool.num_blocks)
    assert (load.requests, load.reserved) == (0, 0)
    assert load.kv_address == d.address and load.kv_address.startswith("tcp://127.0.0.1:")


def test_reserving_an_id_twice_fails_and_leaks_nothing(smollm2_weights: LoadedWeights) -> None:
    """A second `reserve` of a live id is refused as the worker's error, and the first
    reservation stays whole: `cancel` gives every block back. (A worker of its own: a leak here
    must not fail the module's other tests.)"""
    spec = cluster_config().specs(None)[1]
    d = start_worker(dataclasses.replace(spec, cpus=None), smollm2_weights)

    async def run() -> tuple[BaseException | KVHandoff, WorkerLoad]:
        await d.reserve("twice", 40)
        second = (await asyncio.gather(d.reserve("twice", 40), return_exceptions=True))[0]
        await d.cancel("twice")
        return second, await d.load()

    try:
        second, after = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    finally:
        d.close()

    assert isinstance(second, ReservationError), second
    assert (after.reserved, after.free_blocks) == (0, after.total_blocks)
