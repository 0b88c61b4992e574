"""The prefill worker (a Ray actor in the cluster; `core.messages.PrefillApi`).

For each request: reuse the longest cached prefix (own device tier, else host/disk, else a remote
holder named by the index — all inside the engine's scheduler), chunked prefill of the rest, push
each layer's final blocks to the decode worker's reserved blocks as soon as the layer is computed
(the engine's per-layer hook), sample the first token. Full blocks join this worker's prefix
cache and are published to the cluster index.

    result = await worker.prefill(PrefillTask(...))   # returns once the decode side verified all KV

A task with a traceparent is traced (core/tracing.py): a `prefill` span with `prefill.queue`
(arrival -> first scheduled), `prefill.compute` (-> first token; a `chunk` event per engine step
that completed KV blocks of the prompt) and `prefill.kv_push` (-> the decode side verified every
unit: the transfer's exposed tail); its traceparent travels with the KV to the decode side.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace

from halfmoon.core.logs import bind_request
from halfmoon.core.messages import (KVTransferFailedError, PrefillFailedError, PrefillResult, PrefillTask,
                           Timings, TokenChunk, WorkerLoad)
from halfmoon.core.params import FinishReason
from halfmoon.core.tracing import Event, Span, Tracer, now_ns
from halfmoon.core.turns import Turns
from halfmoon.engine.config import WorkerSpec
from halfmoon.engine.worker import EngineWorker
from halfmoon.kvpool.remote import RemoteBlockReader
from halfmoon.transport.errors import TransportError
from halfmoon.transport.faults import FaultInjector
from halfmoon.transport.sender import SentUnit
from halfmoon.transport.tp import RankPeers


class PrefillWorker(EngineWorker):
    def __init__(self, spec: WorkerSpec, remote: RemoteBlockReader | None = None) -> None:
        super().__init__(spec, remote)
        self.faults = FaultInjector()  # drills: corrupt_next_push
        # a sender per (this rank, decode rank) pair, each over its rank's KV shard (transport/tp.py)
        self.peers = RankPeers(self.engine.kv_shards(), spec.transport, faults=self.faults)
        self.pending_tokens = 0  # prompt tokens accepted and not yet prefilled
        self.arrivals = Turns()  # tasks reach the engine in the order they arrived

    async def prefill(self, task: PrefillTask) -> PrefillResult:
        """Prefill `task`, pushing its KV into the decode worker's blocks; raises
        KVTransferFailedError when the KV did not arrive intact, PrefillFailedError when the
        prefill did not complete."""
        bind_request(task.request_id, task.traceparent)
        arrived = now_ns()
        self.learn_block_servers(task.block_servers)
        span = self.tracer.start("prefill", task.traceparent, start_ns=arrived)
        try:
            return await self._prefill(task, span, arrived)
        except TransportError as e:
            error = KVTransferFailedError(f"request {task.request_id!r}: KV push failed: {e}")
            span.fail(error)
            raise error from e
        except BaseException as e:
            span.fail(e)
            raise
        finally:
            span.end()

    async def _prefill(self, task: PrefillTask, span: Span, arrived: int) -> PrefillResult:
        turn = self.arrivals.take()  # to the engine in the order the Conductor sent them (core/turns.py)
        try:
            await self.engine.grammars.prepare(task.params)
            stream = await asyncio.to_thread(self.peers.open, task.handoff.receivers, task.request_id,
                                             task.handoff.block_ids, span.traceparent, span.recording)
            await self.arrivals.wait(turn)
        except BaseException:
            self.arrivals.done(turn)
            raise
        queue = self.loop.watch_async(task.request_id)
        self.pending_tokens += len(task.prompt_ids)
        done = False
        try:
            added = now_ns()
            try:
                self.engine.add_request(task.prompt_ids, task.params, request_id=task.request_id,
                                        cache_salt=task.cache_salt, kv_push=stream, priority=task.priority,
                                        deadline=task.deadline, fetch_from=task.fetch_from)
            finally:
                self.arrivals.done(turn)
            self.loop.wake()
            try:
                final = await self._final(queue, task.timeout_s)
            except PrefillFailedError:
                if stream.error is not None:  # the engine aborted it because its KV push failed
                    raise stream.error from None
                raise
            done = True
            computed = time.perf_counter()
            await asyncio.to_thread(stream.wait, task.timeout_s)  # the decode side verified it all
            result = _result(final, (time.perf_counter() - computed) * 1e3)
            if span.recording:
                assert final.end is not None
                _trace_phases(self.tracer, span, (arrived, added), final.end.timings, stream.log or [])
                span.set(_attributes(task, result, stream.log or []))
            return result
        finally:
            self.pending_tokens -= len(task.prompt_ids)
            if not done:  # cancelled or failed: stop computing, free its blocks
                self.loop.unwatch(task.request_id)
                self.engine.abort(task.request_id)
                self.loop.wake()

    async def corrupt_next_push(self, request_id: str | None = None, times: int = 1) -> None:
        """Drill: flip one bit in the next `times` KV units pushed for `request_id` (a client id
        matches its tries `{id}@{n}`; None: any request). The decode side detects it, the transfer
        fails, and the Conductor re-runs the request if no token had reached the client."""
        self.faults.corrupt_next(request_id=request_id, times=times)

    async def drop_kv_connections(self) -> int:
        """Drill: close every KV connection to the decode workers at once, as a network fault
        would; a push in flight fails (the Conductor re-runs or moves its request) and the next
        push reconnects. How many connections were open."""
        return self.peers.close()

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self.loop.wake()

    async def load(self) -> WorkerLoad:
        return replace(self.engine_load(), pending_tokens=self.pending_tokens)

    @staticmethod
    async def _final(queue: asyncio.Queue, timeout_s: float) -> TokenChunk:
        async with asyncio.timeout(timeout_s):
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise PrefillFailedError(f"the prefill engine failed: {item}") from item
                if item.end is not None:
                    if item.end.finish_reason is FinishReason.ABORT or not item.token_ids:
                        raise PrefillFailedError(f"request {item.request_id!r}: prefill aborted "
                                                 "(its KV push failed or it was cancelled)")
                    return item

    def close(self) -> None:
        self.peers.close()
        super().close()


def _result(final: TokenChunk, push_ms: float) -> PrefillResult:
    end = final.end
    assert end is not None
    return PrefillResult(final.request_id, final.token_ids[0], end.usage.cached_prompt_tokens,
                         end.timings.queue_ms, end.timings.prefill_ms, push_ms)


def _trace_phases(tracer: Tracer, span: Span, times: tuple[int, int], t: Timings,
                  units: Sequence[SentUnit]) -> None:
    """The prefill's phases under `span`, from the engine's timings (`times`: when the task
    arrived, when it entered the engine): queue, compute (with its chunks), the push's tail."""
    arrived, added = times
    scheduled = added + int(t.queue_ms * 1e6)
    first = added + int(t.ttft_ms * 1e6)
    tracer.record("prefill.queue", span, arrived, scheduled)
    tracer.record("prefill.compute", span, scheduled, first, events=_chunks(units))
    tracer.record("prefill.kv_push", span, first, now_ns())


def _chunks(units: Sequence[SentUnit]) -> list[Event]:
    """One `chunk` event per engine step that pushed KV blocks of the prompt: the layers of one
    step come in order, so a layer not above the last one starts the next step's."""
    events: list[Event] = []
    nbytes = 0
    for i, u in enumerate(units):
        nbytes += u.nbytes
        if i + 1 == len(units) or units[i + 1].layer <= u.layer:
            events.append(Event("chunk", u.at_ns, {"chunk": len(events), "blocks": u.blocks,
                                                   "last_layer": u.layer, "bytes": nbytes}))
            nbytes = 0
    return events


def _attributes(task: PrefillTask, result: PrefillResult, units: Sequence[SentUnit]) -> dict:
    return {"halfmoon.request_id": task.request_id, "halfmoon.prompt_tokens": len(task.prompt_ids),
            "halfmoon.cached_prompt_tokens": result.num_cached_tokens, "halfmoon.queue_ms": result.queue_ms,
            "halfmoon.prefill_ms": result.prefill_ms, "halfmoon.push_ms": result.push_ms,
            "halfmoon.kv_units": len(units), "halfmoon.kv_bytes": sum(u.nbytes for u in units),
            "halfmoon.kv_address": task.handoff.address}
