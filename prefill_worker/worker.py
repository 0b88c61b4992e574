"""The prefill worker (a Ray actor in the cluster).

For each request: reuse the longest cached prefix (own device tier, else host/disk, else a remote
holder named by the index — all inside the engine's scheduler), chunked prefill of the rest, push
each layer's final blocks to the decode worker's reserved blocks as soon as the layer is computed
(the engine's per-layer hook), sample the first token. Full blocks join this worker's prefix
cache and are published to the cluster index.

    result = await worker.prefill(PrefillTask(...))   # returns once the decode side verified all KV
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from core.errors import HalfmoonError
from engine.outputs import RequestOutput
from core.params import FinishReason
from core.params import SamplingParams
from engine.worker import EngineWorker, WorkerSpec
from kvpool.remote import RemoteBlockReader
from transport.faults import FaultInjector
from transport.peers import KVPeers


class PrefillFailedError(HalfmoonError):
    """The prefill (or the push of its KV) did not complete; nothing reached the decode side."""


@dataclass(frozen=True, slots=True)
class PrefillTask:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    decode_address: str  # the decode worker's KV receiver
    dst_block_ids: list[int]  # reserved there for this prompt
    timeout_s: float = 60.0


@dataclass(frozen=True, slots=True)
class PrefillResult:
    request_id: str
    first_token: int
    num_cached_tokens: int
    queue_ms: float
    prefill_ms: float
    push_ms: float  # prefill done -> the decode side acknowledged every unit (exposed transfer)


class PrefillWorker(EngineWorker):
    def __init__(self, spec: WorkerSpec, remote: RemoteBlockReader | None = None) -> None:
        super().__init__(spec, remote)
        self.faults = FaultInjector()  # drills: corrupt_next_push
        self.peers = KVPeers(self.engine.kv_cache, self.layout, spec.transport, faults=self.faults)
        self.pending_tokens = 0  # prompt tokens accepted and not yet prefilled

    async def prefill(self, task: PrefillTask) -> PrefillResult:
        """Prefill `task`, pushing its KV into the decode worker's blocks; raises
        PrefillFailedError (or the transport's error) when the KV did not arrive intact."""
        sender = await asyncio.to_thread(self.peers.sender, task.decode_address)
        stream = sender.open(task.request_id, task.dst_block_ids)
        queue = self.loop.watch_async(task.request_id)
        self.pending_tokens += len(task.prompt_ids)
        done = False
        try:
            self.engine.add_request(task.prompt_ids, task.params, request_id=task.request_id,
                                    cache_salt=task.cache_salt, kv_push=stream)
            self.loop.wake()
            final = await self._final(queue, task.timeout_s)
            done = True
            computed = time.perf_counter()
            await asyncio.to_thread(stream.wait, task.timeout_s)  # the decode side verified it all
            return _result(task.request_id, final, (time.perf_counter() - computed) * 1e3)
        finally:
            self.pending_tokens -= len(task.prompt_ids)
            if not done:  # cancelled or failed: stop computing, free its blocks
                self.loop.unwatch(task.request_id)
                self.engine.abort(task.request_id)
                self.loop.wake()

    async def corrupt_next_push(self, request_id: str | None = None, times: int = 1) -> None:
        """Drill: flip one bit in the next `times` KV units pushed for `request_id` (None: any
        request). The decode side detects it, the transfer fails, and the Conductor re-runs the
        request if no token had reached the client."""
        self.faults.corrupt_next(request_id=request_id, times=times)

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self.loop.wake()

    def load(self) -> dict:
        return {**self.ping(), "pending_tokens": self.pending_tokens}

    @staticmethod
    async def _final(queue: asyncio.Queue, timeout_s: float) -> RequestOutput:
        async with asyncio.timeout(timeout_s):
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise PrefillFailedError(f"the prefill engine failed: {item}") from item
                if item.finished:
                    if item.finish_reason is FinishReason.ABORT or item.result is None:
                        raise PrefillFailedError(f"request {item.request_id!r}: prefill aborted "
                                                 "(its KV push failed or it was cancelled)")
                    return item

    def close(self) -> None:
        self.peers.close()
        super().close()


def _result(request_id: str, final: RequestOutput, push_ms: float) -> PrefillResult:
    r = final.result
    assert r is not None
    return PrefillResult(request_id, r.output_ids[0], r.num_cached_tokens, r.queue_ms, r.prefill_ms, push_ms)
