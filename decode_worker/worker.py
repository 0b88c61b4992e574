"""The decode worker (a Ray actor in the cluster; `core.messages.DecodeApi`).

    handoff = await worker.reserve(request_id, num_prompt_tokens)   # KVHandoff(address, blocks)
    ... the prefill worker pushes the prompt's KV into those blocks layer by layer ...
    async for chunk in worker.generate(DecodeTask(...)):   # TokenChunks; the last one has `end`
        ...

`generate` waits until every layer arrived and verified, joins the request to the running batch
(`add_prefilled`, with the first token and sampler state sampled by the prefill worker) and
streams its tokens. A transfer that fails (checksum, prefill worker lost, timeout) or a cancel
returns the reserved blocks; after a normal finish the blocks stay as prefix cache.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from core.messages import (DecodeFailedError, DecodeTask, KVHandoff, KVTransferFailedError,
                           PrefilledKV, ReservationError, TokenChunk, WorkerLoad)
from engine.config import WorkerSpec
from engine.worker import EngineWorker
from kvpool.remote import RemoteBlockReader
from transport.config import advertised_address
from transport.errors import TransportError
from transport.receiver import KVReceiver


class DecodeWorker(EngineWorker):
    def __init__(self, spec: WorkerSpec, remote: RemoteBlockReader | None = None) -> None:
        super().__init__(spec, remote)
        backend = spec.transport.make_backend()
        self.receiver = KVReceiver(self.engine.kv_cache, self.layout, backend, host=spec.transport.host,
                                   port=spec.transport.port, secret=spec.transport.secret(),
                                   timeout=spec.transport.timeout_s).start()
        self.address = advertised_address(self.receiver.address, spec.transport.host)
        self._reserved: dict[str, list[int]] = {}

    async def reserve(self, request_id: str, num_tokens: int) -> KVHandoff:
        """Blocks for a prompt's KV, open to the transport for this request only; an id that
        holds a reservation already is refused before anything is allocated."""
        if request_id in self._reserved:
            raise ReservationError(f"request {request_id!r} already holds a KV reservation here")
        self._reserved[request_id] = []  # claimed now: a concurrent reserve of the id is refused
        try:
            blocks: list[int] = await self.on_engine(lambda: self.engine.reserve_blocks(num_tokens))  # type: ignore[assignment]
        except BaseException:
            del self._reserved[request_id]
            raise
        self._reserved[request_id] = blocks
        try:
            self.receiver.expect(request_id, blocks)
        except TransportError as e:  # the receiver cannot take it (e.g. it is closing)
            await self._release(request_id)
            raise KVTransferFailedError(f"request {request_id!r}: the KV receiver refused it: {e}") from e
        return KVHandoff(self.address, blocks)

    async def generate(self, task: DecodeTask) -> AsyncIterator[TokenChunk]:
        """Wait for the KV, then stream the request's tokens (the first one included)."""
        self.learn_block_servers(task.block_servers)
        prefilled = await self._receive(task)
        queue = self.loop.watch_async(task.request_id)
        finished = False
        try:
            await self._join(task, prefilled)
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise DecodeFailedError(f"the decode engine failed: {item}") from item
                finished = item.finished
                yield item
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

    async def _receive(self, task: DecodeTask) -> PrefilledKV:
        try:
            result = await asyncio.to_thread(self.receiver.wait, task.request_id, task.timeout_s)
        except TransportError as e:
            await self._release(task.request_id)
            raise KVTransferFailedError(f"request {task.request_id!r}: KV transfer failed: {e}") from e
        except BaseException:  # cancelled while waiting: nothing more may be written there
            self.receiver.cancel(task.request_id)
            await self._release(task.request_id)
            raise
        return PrefilledKV.from_meta(result.meta)

    async def _join(self, task: DecodeTask, prefilled: PrefilledKV) -> None:
        blocks = self._reserved.pop(task.request_id)

        def add() -> None:
            self.engine.add_prefilled(task.prompt_ids, prefilled.first_token, task.params, blocks,
                                      request_id=task.request_id, cache_salt=task.cache_salt,
                                      generator_state=prefilled.generator_state)

        try:
            await self.on_engine(add)
        except BaseException:
            await self._give_back(blocks)
            raise

    async def _release(self, request_id: str) -> None:
        blocks = self._reserved.pop(request_id, None)
        if blocks:
            await self._give_back(blocks)

    async def _give_back(self, blocks: list[int]) -> None:
        await self.on_engine(lambda: self.engine.release_blocks(blocks))

    async def load(self) -> WorkerLoad:
        return replace(self.engine_load(), reserved=len(self._reserved), kv_address=self.address)

    def close(self) -> None:
        self.receiver.close()
        super().close()

