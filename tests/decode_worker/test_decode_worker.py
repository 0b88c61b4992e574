"""The decode worker driven directly, beside a real prefill worker: no Ray, no Conductor.

`reserve` hands out blocks for the prompt and every output token and the receiver's address,
`generate` waits for the KV and streams `TokenChunk`s, `cancel` gives a reservation back
wherever the request is, `load` releases reservations past their deadline, `check_integrity`
checks the bookkeeping. After every test both workers are idle: nothing watched or reserved,
every block free, pools and workers consistent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar
from unittest import mock

import pytest

from halfmoon.core.blocks import cdiv
from halfmoon.core.errors import InvalidRequestError
from halfmoon.core.messages import (DecodeCapacityError, DecodeTask, EngineInfo, IntegrityError,
                           IntegrityReport, KVHandoff, KVTransferFailedError, ReservationError,
                           TokenChunk, WorkerLoad)
from halfmoon.core.params import FinishReason, SamplingParams
from halfmoon.decode_worker.worker import Reservation
from halfmoon.engine.engine import Engine
from halfmoon.engine.loader import LoadedWeights
from tests.waiting import wait_until
from tests.workers_support import (TIMEOUT_S, InProcessWorkers, cluster_config, drain, run_pair,
                                   start_worker, tokens)

T = TypeVar("T")

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
    """The reservation holds the prompt's blocks and room for every new token; the handoff
    (where the prefill worker pushes) lists only the prompt's."""
    d = workers.decode
    total = d.engine.pool.num_blocks

    async def run() -> tuple[list[int], WorkerLoad, IntegrityReport, WorkerLoad, IntegrityReport]:
        handoff = await d.reserve("held", 40, 20, TIMEOUT_S)  # 40 + 20 tokens: 3 + 1 blocks of 16
        held, held_report = await d.load(), await d.check_integrity()
        await d.cancel("held")
        return handoff.block_ids, held, held_report, await d.load(), await d.check_integrity()

    block_ids, held, held_report, after, after_report = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))

    assert len(block_ids) == 3 and len(set(block_ids)) == 3
    assert (held.reserved, held.reserved_blocks, held.free_blocks) == (1, 4, total - 4)
    assert (held_report.reservations, held_report.reserved_blocks) == (1, 4)
    assert (after.reserved, after.reserved_blocks, after.free_blocks) == (0, 0, total)
    assert after_report == IntegrityReport(d.spec.worker_id, 0, 0, 0, total, total)


def test_a_full_reservation_decodes_without_allocating(workers: InProcessWorkers, engine: Engine) -> None:
    """Every output token's block was reserved up front: the engine allocates nothing while
    the request decodes (one allocation in all: the reservation), the tokens are one engine's,
    and the unused tail is free again after the finish."""
    d = workers.decode
    prompt = engine.tokenizer.encode("Count from one to twenty: one, two,")
    params = SamplingParams(max_tokens=40, ignore_eos=True)  # crosses several block boundaries
    expected = engine.generate([prompt], params)[0].output_ids
    pool = d.engine.pool

    with mock.patch.object(pool, "allocate", wraps=pool.allocate) as allocate:
        _, chunks = asyncio.run(run_pair(workers.prefill, d, "roomy", prompt, params))

    assert tokens(chunks) == expected
    assert [c.args for c in allocate.call_args_list] == [(cdiv(len(prompt) + params.max_tokens, 16),)]
    assert chunks[-1].end is not None and chunks[-1].end.num_preemptions == 0
    report = asyncio.run(d.check_integrity())
    assert (report.reservations, report.requests, report.free_blocks) == (0, 0, report.total_blocks)


def test_a_reservation_the_pool_cannot_hold_is_a_capacity_error(workers: InProcessWorkers) -> None:
    """Too few free blocks for prompt + max_new_tokens: DecodeCapacityError with both counts,
    nothing allocated, the id free to reserve again."""
    d = workers.decode
    total = d.engine.pool.num_blocks

    async def run() -> tuple[BaseException | KVHandoff, WorkerLoad]:
        await d.reserve("hog", 16 * (total - 10), 0, TIMEOUT_S)  # leaves 10 blocks free
        refused = (await asyncio.gather(d.reserve("big", 16 * 8, 16 * 4, TIMEOUT_S),
                                        return_exceptions=True))[0]
        load = await d.load()
        await d.cancel("hog")
        return refused, load

    refused, load = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))

    assert isinstance(refused, DecodeCapacityError), refused
    assert (refused.requested, refused.free) == (12, 10)
    assert (load.reserved, load.reserved_blocks, load.free_blocks) == (1, total - 10, 10)


def test_a_reservation_past_its_deadline_is_released_by_load(workers: InProcessWorkers,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Nobody comes for the KV (a dead Conductor): once past its deadline the reservation is an
    integrity problem, and the next `load` releases it, naming the request in a warning."""
    d = workers.decode
    total = d.engine.pool.num_blocks

    async def run() -> tuple[IntegrityError, WorkerLoad]:
        loop = asyncio.get_running_loop()
        await d.reserve("orphan", 40, 8, 0.05)

        def integrity_error() -> IntegrityError | None:
            try:
                on_loop(loop, d.check_integrity())
            except IntegrityError as e:
                return e
            return None

        error = await asyncio.to_thread(wait_until, integrity_error, TIMEOUT_S, "the deadline to pass")
        load = await asyncio.to_thread(wait_until, lambda: _idle_load(on_loop(loop, d.load()), total),
                                       TIMEOUT_S, "load() to release the reservation")
        return error, load

    with caplog.at_level(logging.WARNING, logger="halfmoon.decode_worker.worker"):
        error, load = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))

    assert "'orphan' is" in str(error) and "past its deadline" in str(error)
    assert (load.reserved, load.reserved_blocks) == (0, 0)
    assert "'orphan'" in caplog.text and "deadline" in caplog.text
    assert "orphan" not in d.receiver.pending()


def test_generate_after_its_reservation_expired_fails(workers: InProcessWorkers) -> None:
    """A `generate` waiting for KV whose reservation expires fails as a transfer failure (the
    Conductor may run the request again); the blocks are free."""
    d = workers.decode
    prompt = list(range(100, 140))
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def run() -> BaseException | list[TokenChunk]:
        await d.reserve("late", len(prompt), params.max_tokens, 0.2)
        stream = asyncio.ensure_future(drain(d.generate(DecodeTask("late", prompt, params, None, TIMEOUT_S))))
        loop = asyncio.get_running_loop()
        await asyncio.to_thread(wait_until, lambda: on_loop(loop, d.load()).reserved == 0, TIMEOUT_S,
                                "load() to release the reservation")
        return (await asyncio.gather(stream, return_exceptions=True))[0]

    outcome = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))

    assert isinstance(outcome, KVTransferFailedError), outcome


def test_add_prefilled_takes_the_prompt_s_blocks_up_to_room_for_max_tokens(workers: InProcessWorkers) -> None:
    e = workers.decode.engine
    prompt, params = list(range(100, 140)), SamplingParams(max_tokens=30)  # 3 to 5 blocks

    for blocks in ([0, 1], [0, 1, 2, 3, 4, 5]):
        with pytest.raises(InvalidRequestError, match="3 to 5"):
            e.add_prefilled(prompt, 7, params, blocks, request_id="miscounted")
    assert not e.has_unfinished()


def test_check_integrity_names_every_broken_invariant(smollm2_weights: LoadedWeights) -> None:
    """Deliberately corrupted states, one after another, each named by `check_integrity`. (A
    worker of its own: it is left broken.)"""
    spec = cluster_config().specs(None)[1]
    d = start_worker(dataclasses.replace(spec, cpus=None), smollm2_weights)

    async def problems() -> str:
        with pytest.raises(IntegrityError) as caught:
            await d.check_integrity()
        return str(caught.value)

    async def run() -> list[str]:
        found = []
        await d.reserve("a", 40, 8, TIMEOUT_S)
        d.receiver.cancel("a")  # the receiver forgets it, the reservation stays
        found.append(await problems())
        b = await d.reserve("b", 40, 8, TIMEOUT_S)
        await d.on_engine(lambda: d.engine.pool.free(b.block_ids[:1]))  # reserved, yet on the free list
        found.append(await problems())
        d._reserved["c"] = Reservation(b.block_ids[1:2], 1, d._reserved["b"].deadline)  # shares b's
        found.append(await problems())
        return found

    try:
        found = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    finally:
        d.close()

    assert "'a' is for KV the receiver no longer expects" in found[0]
    assert "reserved for 'b' is not in use" in found[1] and "'b' is for KV" not in found[1]
    assert "is reserved for both 'b' and 'c'" in found[2]


def on_loop(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on `loop` (running in another thread) and wait for its result."""
    return asyncio.run_coroutine_threadsafe(coro, loop).result(TIMEOUT_S)


def _idle_load(load: WorkerLoad, total: int) -> WorkerLoad | None:
    return load if load.reserved == 0 and load.free_blocks == total else None


def test_cancel_while_waiting_for_kv_returns_the_reservation(workers: InProcessWorkers) -> None:
    """No prefill ever comes: `generate` waits for the KV until `cancel` stops it; it raises,
    and the reserved blocks are free again."""
    d = workers.decode
    prompt = list(range(100, 150))
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def run() -> tuple[BaseException | list[TokenChunk], WorkerLoad]:
        await d.reserve("waiting", len(prompt), params.max_tokens, TIMEOUT_S)
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
        await d.reserve("twice", 40, 8, TIMEOUT_S)
        second = (await asyncio.gather(d.reserve("twice", 40, 8, TIMEOUT_S), return_exceptions=True))[0]
        await d.cancel("twice")
        return second, await d.load()

    try:
        second, after = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    finally:
        d.close()

    assert isinstance(second, ReservationError), second
    assert (after.reserved, after.free_blocks) == (0, after.total_blocks)
