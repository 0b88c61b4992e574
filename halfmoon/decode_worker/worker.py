"""The decode worker (a Ray actor in the cluster; `core.messages.DecodeApi`).

    handoff = await worker.reserve(request_id, num_prompt_tokens, max_new_tokens, timeout_s)
    ... the prefill worker pushes the prompt's KV into handoff.block_ids layer by layer ...
    async for chunk in worker.generate(DecodeTask(...)):   # TokenChunks; the last one has `end`
        ...

`reserve` allocates every block the request can use at once, so once it joins the running
batch the engine allocates nothing for it (and a batch of such requests never preempts for
memory); a pool too full for it is `DecodeCapacityError` up front:

    | prompt's blocks (in the handoff) | room for max_new_tokens (stays here) |

`generate` waits until every layer arrived and verified, joins the request to the running batch
(`add_prefilled` with the whole reservation as its block table, the first token and sampler
state sampled by the prefill worker) and streams its tokens. A transfer that fails (checksum,
prefill worker lost, timeout), a cancel, or a reservation that has not joined by its deadline
(its Conductor is gone) returns the reserved blocks; after a normal finish the prompt's blocks
stay as prefix cache and the unused room is free.

A task with a traceparent is traced (core/tracing.py): a `decode` span with `decode.kv_wait`
(the task arrived -> its KV verified), `decode.queue` (-> the engine emitted its first token, the
prefill's), `decode.compute` (-> its last token), a `first_token` event, the finish reason and
token count; and a `kv_transfer` span under the prefill worker's span (its traceparent came with
the KV) from the first unit to the last, with one `kv.layer` event per layer (units, blocks,
bytes, xxh3-64 checksums).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace

from halfmoon.core.blocks import cdiv
from halfmoon.core.errors import InvalidRequestError
from halfmoon.core.logs import bind_request
from halfmoon.core.messages import (DecodeCapacityError, DecodeFailedError, DecodeTask, KVHandoff,
                           KVTransferFailedError, PrefilledKV, ReservationError, TokenChunk,
                           WorkerLoad)
from halfmoon.core.tracing import Event, Span, now_ns
from halfmoon.engine.config import WorkerSpec
from halfmoon.engine.worker import EngineWorker
from halfmoon.kvpool.errors import OutOfBlocksError
from halfmoon.kvpool.remote import RemoteBlockReader
from halfmoon.transport.staging import STAGED
from halfmoon.transport.config import advertised_address
from halfmoon.transport.errors import TransportError
from halfmoon.transport.receiver import TransferResult
from halfmoon.transport.tp import RankReceivers

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Reservation:
    """A request's blocks from `reserve` until it joins the running batch (or is released)."""

    blocks: list[int]  # block-table order: the prompt's first, then room for the new tokens
    prompt_blocks: int
    deadline: float  # time.monotonic(): released by the next `load` or `reserve` after it

    @property
    def prompt(self) -> list[int]:
        """Where the prefill worker pushes the prompt's KV."""
        return self.blocks[: self.prompt_blocks]


class DecodeWorker(EngineWorker):
    def __init__(self, spec: WorkerSpec, remote: RemoteBlockReader | None = None) -> None:
        super().__init__(spec, remote)
        # a receiver per rank over its KV shard: each rank receives only its heads (transport/tp.py)
        self.receiver = RankReceivers(self.engine.kv_shards(), spec.transport)
        self.addresses = tuple(advertised_address(a, spec.transport.host) for a in self.receiver.addresses)
        self.address = self.addresses[0]
        self._reserved: dict[str, Reservation] = {}
        self._claimed: set[str] = set()  # ids whose blocks are being allocated
        self._receiving: set[str] = set()  # ids whose `generate` waits for (or just got) the KV

    async def reserve(self, request_id: str, num_prompt_tokens: int, max_new_tokens: int,
                      timeout_s: float) -> KVHandoff:
        """Blocks for the prompt and `max_new_tokens` output tokens, all at once; the handoff
        lists the prompt's, open to the transport for this request only. Refused before
        anything is allocated: an id that holds a reservation already (ReservationError), a
        pool with too few free blocks (DecodeCapacityError). Released unless the request
        joins (`generate`) within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        _check_reserve(num_prompt_tokens, max_new_tokens, timeout_s)
        if request_id in self._reserved or request_id in self._claimed:
            raise ReservationError(f"request {request_id!r} already holds a KV reservation here")
        self._claimed.add(request_id)  # a concurrent reserve of the id is refused
        num_tokens = num_prompt_tokens + max_new_tokens
        try:
            self._release_expired()  # their blocks are freed before this allocation runs
            blocks: list[int] = await self.on_engine(lambda: self.engine.reserve_blocks(num_tokens))  # type: ignore[assignment]
        except OutOfBlocksError as e:
            raise DecodeCapacityError(e.requested, e.free) from e
        finally:
            self._claimed.discard(request_id)
        reservation = Reservation(blocks, cdiv(num_prompt_tokens, self.engine.config.block_size), deadline)
        self._reserved[request_id] = reservation
        try:
            self.receiver.expect(request_id, reservation.prompt, record=self.tracer.enabled)
        except TransportError as e:  # the receiver cannot take it (e.g. it is closing)
            await self._release(request_id)
            raise KVTransferFailedError(f"request {request_id!r}: the KV receiver refused it: {e}") from e
        return KVHandoff(self.address, reservation.prompt, self.addresses if len(self.addresses) > 1 else ())

    async def generate(self, task: DecodeTask) -> AsyncIterator[TokenChunk]:
        """Wait for the KV, then stream the request's tokens (the first one included)."""
        bind_request(task.request_id, task.traceparent)
        span = self.tracer.start("decode", task.traceparent)
        self.learn_block_servers(task.block_servers)
        finished = False
        try:
            phase = now_ns()
            prefilled = await self._receive(task, span)
            phase = self._phase(span, "decode.kv_wait", phase)
            await self.engine.grammars.prepare(task.params)
            queue = self.loop.watch_async(task.request_id)
            await self._join(task, prefilled)
            tokens = 0
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise DecodeFailedError(f"the decode engine failed: {item}") from item
                finished = item.finished
                if span.recording:
                    phase, tokens = self._progress(span, item, phase, tokens)
                yield item
        except BaseException as e:
            span.fail(e)
            raise
        finally:
            span.end()
            if not finished:
                self.loop.unwatch(task.request_id)
                self.engine.abort(task.request_id)
                self.loop.wake()

    def _phase(self, span: Span, name: str, start_ns: int) -> int:
        """Record phase `name` of `span` from `start_ns` to now; now (the next phase's start)."""
        end = now_ns()
        self.tracer.record(name, span, start_ns, end)
        return end

    def _progress(self, span: Span, item: TokenChunk, phase: int, tokens: int) -> tuple[int, int]:
        """A traced request's chunk: the first ends its queue wait, the last its compute."""
        if not tokens:
            span.event("first_token")
            phase = self._phase(span, "decode.queue", phase)
        tokens += len(item.token_ids)
        if len(item.token_ids) > 1 and tokens > len(item.token_ids):  # a verification's several tokens
            span.event("speculative_verification", {"halfmoon.tokens": len(item.token_ids)})
        if item.end is not None:
            self._phase(span, "decode.compute", phase)
            end = item.end
            span.set({"halfmoon.request_id": item.request_id, "halfmoon.finish_reason": end.finish_reason.value,
                      "halfmoon.output_tokens": tokens, "halfmoon.preemptions": end.num_preemptions,
                      "halfmoon.speculative.proposed": end.speculative_proposed,
                      "halfmoon.speculative.accepted": end.speculative_accepted})
        return phase, tokens

    async def cancel(self, request_id: str) -> None:
        """Stop a request wherever it is: waiting for KV (blocks returned) or decoding (aborted)."""
        self.receiver.cancel(request_id)
        await self._release(request_id)
        self.engine.abort(request_id)
        self.loop.wake()

    async def _receive(self, task: DecodeTask, span: Span) -> PrefilledKV:
        self._receiving.add(task.request_id)
        try:
            result = await asyncio.to_thread(self.receiver.wait, task.request_id, task.timeout_s)
            if span.recording:
                self._trace_transfer(span, result)
        except TransportError as e:
            await self._release(task.request_id)
            raise KVTransferFailedError(f"request {task.request_id!r}: KV transfer failed: {e}") from e
        except BaseException:  # cancelled while waiting: nothing more may be written there
            self.receiver.cancel(task.request_id)
            await self._release(task.request_id)
            raise
        finally:
            self._receiving.discard(task.request_id)
        return PrefilledKV.from_meta(result.meta)

    def _trace_transfer(self, span: Span, result: TransferResult) -> None:
        """The KV transfer as a span of the sender's (the prefill worker's traceparent came with
        the KV; else under this request's `span`): its first unit to now, one event per layer."""
        end = now_ns()
        start = result.first_unit_ns or end
        self.tracer.record("kv_transfer", result.traceparent or span, start, end, {
            "halfmoon.request_id": result.request_id, "halfmoon.kv_units": result.num_units,
            "halfmoon.kv_bytes": result.num_bytes, "halfmoon.worker": self.spec.worker_id},
            _layer_events(result))

    async def _join(self, task: DecodeTask, prefilled: PrefilledKV) -> None:
        reservation = self._reserved.pop(task.request_id, None)
        if reservation is None:  # its KV arrived as its deadline passed: released already
            raise KVTransferFailedError(f"request {task.request_id!r}: its KV reservation expired")
        blocks = reservation.blocks

        def add() -> None:
            self.engine.add_prefilled(task.prompt_ids, prefilled.first_token, task.params, blocks,
                                      request_id=task.request_id, cache_salt=task.cache_salt,
                                      generator_state=prefilled.generator_state,
                                      first_logprobs=prefilled.first_logprobs,
                                      prompt_logprobs=prefilled.prompt_logprobs,
                                      choices=prefilled.choices)

        try:
            await self.on_engine(add)
        except BaseException:
            await self._give_back(blocks)
            raise

    async def _release(self, request_id: str) -> None:
        reservation = self._reserved.pop(request_id, None)
        if reservation is not None:
            await self._give_back(reservation.blocks)

    async def _give_back(self, blocks: list[int]) -> None:
        await self.on_engine(lambda: self.engine.release_blocks(blocks))

    def _release_expired(self) -> None:
        """Give back the reservations past their deadline: their request never joined, so
        whoever made them is gone (or gave up) and nothing else would free their blocks. The
        receiver lets go of them first (a `generate` still waiting fails); the blocks are
        freed on the engine thread without waiting for it (a `load` never waits for a step)."""
        now = time.monotonic()
        expired = sorted(rid for rid, r in self._reserved.items() if r.deadline <= now)
        blocks: list[int] = []
        for request_id in expired:
            reservation = self._reserved.pop(request_id)
            self.receiver.cancel(request_id)
            blocks += reservation.blocks
            log.warning("request %r: its KV reservation of %d blocks passed its deadline %.1f s ago "
                        "without the request joining; released", request_id, len(reservation.blocks),
                        now - reservation.deadline)
        if blocks:
            self.loop.call(lambda: self.engine.release_blocks(blocks)).add_done_callback(_log_failure)

    def held_blocks(self) -> Mapping[str, Sequence[int]]:
        return {rid: r.blocks for rid, r in self._reserved.items()}

    def hold_problems(self) -> list[str]:
        """A reservation outlives its request: past its deadline, or its KV neither expected
        by the receiver nor being received by a `generate`."""
        now, expected = time.monotonic(), set(self.receiver.pending())
        problems = []
        for request_id, reservation in sorted(self._reserved.items()):
            if reservation.deadline <= now:
                problems.append(f"the reservation of {request_id!r} is {now - reservation.deadline:.1f} s "
                                "past its deadline")
            if request_id not in expected and request_id not in self._receiving:
                problems.append(f"the reservation of {request_id!r} is for KV the receiver no longer expects")
        return problems

    async def load(self) -> WorkerLoad:
        """As every worker's, plus the reservations (expired ones are released first)."""
        self._release_expired()
        reserved_blocks = sum(len(r.blocks) for r in self._reserved.values())
        return replace(self.engine_load(), reserved=len(self._reserved) + len(self._claimed),
                       reserved_blocks=reserved_blocks, kv_address=self.address,
                       kv_bytes_received=sum(self.receiver.rank_bytes),
                       kv_rank_bytes=tuple(self.receiver.rank_bytes),
                       kv_bytes_staged=self.receiver.path_bytes(STAGED))

    def close(self) -> None:
        self.receiver.close()
        super().close()


def _check_reserve(num_prompt_tokens: int, max_new_tokens: int, timeout_s: float) -> None:
    if num_prompt_tokens < 1:
        raise InvalidRequestError("num_prompt_tokens", f"must be >= 1, got {num_prompt_tokens}")
    if max_new_tokens < 0:
        raise InvalidRequestError("max_new_tokens", f"must be >= 0, got {max_new_tokens}")
    if not timeout_s > 0:
        raise InvalidRequestError("timeout_s", f"must be > 0, got {timeout_s}")


def _layer_events(result: TransferResult) -> list[Event]:
    """One `kv.layer` event per layer (at its last unit's verification): its units, blocks,
    bytes and the xxh3-64 checksum of each unit (hex, in arrival order)."""
    by_layer: dict[int, list] = {}
    for unit in result.units:
        by_layer.setdefault(unit.layer, []).append(unit)
    return [Event("kv.layer", units[-1].at_ns, {
        "layer": layer, "units": len(units), "blocks": sum(u.blocks for u in units),
        "bytes": sum(u.nbytes for u in units), "checksums": [f"{u.checksum:016x}" for u in units]})
        for layer, units in sorted(by_layer.items())]


def _log_failure(future: Future) -> None:
    """Done-callback of a give-back nobody awaits: its error goes to the log, not lost."""
    if not future.cancelled() and future.exception() is not None:
        log.error("giving back expired KV reservations failed: %s", future.exception())
