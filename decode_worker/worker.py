"""The decode worker (a Ray actor in the cluster).

    address, blocks = await worker.reserve(request_id, num_prompt_tokens)
    ... the prefill worker pushes the prompt's KV into `blocks` layer by layer ...
    async for event in worker.generate(DecodeTask(...)):   # first token, deltas, then the end
        ...

`generate` waits until every layer arrived and verified, joins the request to the running batch
(`add_prefilled`, with the first token and sampler state sampled by the prefill worker) and
streams its tokens. A transfer that fails (checksum, prefill worker lost, timeout) or a cancel
returns the reserved blocks; after a normal finish the blocks stay as prefix cache.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from core.errors import HalfmoonError
from core.params import SamplingParams
from engine.worker import EngineWorker, WorkerSpec
from kvpool.remote import RemoteBlockReader
from transport.config import advertised_address
from transport.errors import TransportError
from transport.receiver import KVReceiver


class DecodeFailedError(HalfmoonError):
    """The request could not be decoded here (its KV never arrived intact, or the engine failed)."""


class KVTransferFailedError(DecodeFailedError):
    """The request's KV did not arrive intact (sender lost, timeout, checksum mismatch); its
    blocks were given back. Nothing was decoded, so the Conductor may re-run the request."""


@dataclass(frozen=True, slots=True)
class DecodeTask:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    block_ids: list[int]
    timeout_s: float = 60.0


@dataclass(frozen=True, slots=True)
class DecodeEvent:
    """New tokens and text; `finish_reason` and the timings are set on the last event."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop: str | None = None
    num_output_tokens: int = 0
    kv_wait_ms: float = 0.0  # generate() called -> every layer in and verified
    tpot_ms: float = 0.0


class DecodeWorker(EngineWorker):
    def __init__(self, spec: WorkerSpec, remote: RemoteBlockReader | None = None) -> None:
        super().__init__(spec, remote)
        backend = spec.transport.make_backend()
        self.receiver = KVReceiver(self.engine.kv_cache, self.layout, backend, host=spec.transport.host,
                                   port=spec.transport.port, secret=spec.transport.secret(),
                                   timeout=spec.transport.timeout_s).start()
        self.address = advertised_address(self.receiver.address, spec.transport.host)
        self._reserved: dict[str, list[int]] = {}

    async def reserve(self, request_id: str, num_tokens: int) -> tuple[str, list[int]]:
        """Blocks for a prompt's KV, open to the transport for this request only."""
        blocks: list[int] = await self.on_engine(lambda: self.engine.reserve_blocks(num_tokens))  # type: ignore[assignment]
        self._reserved[request_id] = blocks
        self.receiver.expect(request_id, blocks)
        return self.address, blocks

    async def generate(self, task: DecodeTask) -> AsyncIterator[DecodeEvent]:
        """Wait for the KV, then stream the request's tokens (the first one included)."""
        t0 = time.perf_counter()
        meta = await self._receive(task)
        kv_wait_ms = (time.perf_counter() - t0) * 1e3
        queue = self.loop.watch_async(task.request_id)
        finished = False
        try:
            await self._join(task, meta)
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise DecodeFailedError(f"the decode engine failed: {item}") from item
                finished = item.finished
                yield _event(item, kv_wait_ms)
        finally:
            if not finished:
                self.loop.unwatch(task.request_id)
                self.engine.abort(task.request_id)
                self.loop.wake()

    async def cancel(self, request_id: str) -> None:
        """Stop a request wherever it is: waiting for KV (blocks returned) or decoding (aborted)."""
        self.receiver.cancel(request_id)
        await self._release(request_id)
        self.engine.abort(request_id)
        self.loop.wake()

    async def _receive(self, task: DecodeTask) -> dict:
        try:
            result = await asyncio.to_thread(self.receiver.wait, task.request_id, task.timeout_s)
        except TransportError as e:
            await self._release(task.request_id)
            raise KVTransferFailedError(f"request {task.request_id!r}: KV transfer failed: {e}") from e
        except BaseException:  # cancelled while waiting: nothing more may be written there
            self.receiver.cancel(task.request_id)
            await self._release(task.request_id)
            raise
        return result.meta

    async def _join(self, task: DecodeTask, meta: dict) -> None:
        state = meta.get("generator_state")
        blocks = self._reserved.pop(task.request_id)

        def add() -> None:
            self.engine.add_prefilled(task.prompt_ids, meta["first_token"], task.params, blocks,
                                      request_id=task.request_id, cache_salt=task.cache_salt,
                                      generator_state=bytes.fromhex(state) if state else None)

        try:
            await self.on_engine(add)
        except BaseException:
            await self.on_engine(lambda: self.engine.release_blocks(blocks))
            raise

    async def _release(self, request_id: str) -> None:
        blocks = self._reserved.pop(request_id, None)
        if blocks is not None:
            await self.on_engine(lambda: self.engine.release_blocks(blocks))

    def load(self) -> dict:
        return {**self.ping(), "reserved": len(self._reserved), "address": self.address}

    def close(self) -> None:
        self.receiver.close()
        super().close()


def _event(out, kv_wait_ms: float) -> DecodeEvent:  # out: RequestOutput
    if not out.finished:
        return DecodeEvent(out.new_token_ids, out.new_text)
    r = out.result
    reason = out.finish_reason.value if out.finish_reason is not None else "abort"
    return DecodeEvent(out.new_token_ids, out.new_text, reason, r.stop_text if r else None,
                       len(r.output_ids) if r else 0, kv_wait_ms, r.tpot_ms if r else 0.0)
