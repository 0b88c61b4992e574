"""The co-located backend: one engine in this process, stepped by one thread.

```
event loop (gRPC + HTTP handlers)            engine thread (engine/loop.py)
  generate(): watch_async(id), add_request -> engine.step() ... outputs
  await queue.get()  <-- call_soon_threadsafe -- one put per request per step
  closed early -> engine.abort(id)  -------->  freed at the start of the next step
```

Admission is simple here (the cluster's Mooncake-style predictor comes with the Conductor): a
bounded number of requests waiting for their first token, and a per-request SLO check against
predictions from what this engine measured (prefill tokens/s, time per output token).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from conductor.backend import BackendStats, GenerationBackend, GenerationInput
from conductor.errors import (DeadlineExceededError, OverloadedError, ServiceUnavailableError,
                              SloMissError, SloPrediction)
from core.messages import RequestEnd, TokenChunk
from engine.engine import Engine
from engine.loop import EngineLoop
from core.errors import InvalidRequestError
from halfmoon.results import ModelInfo

_Item = TokenChunk | BaseException


@dataclass(slots=True)
class _Stream:
    queue: asyncio.Queue[_Item]
    prompt_tokens: int
    started: bool = False  # first token seen


class LoadPredictor:
    """Exponentially weighted averages of what the engine delivered: prefill tokens per ms and
    time per output token. Unknown (None) until the first request finished."""

    ALPHA = 0.2

    def __init__(self) -> None:
        self.prefill_tokens_per_ms: float | None = None
        self.tpot_ms: float | None = None

    def observe(self, end: RequestEnd) -> None:
        u, t = end.usage, end.timings
        computed = u.prompt_tokens - u.cached_prompt_tokens
        if computed > 0 and t.prefill_ms > 0:
            self.prefill_tokens_per_ms = self._ewma(self.prefill_tokens_per_ms, computed / t.prefill_ms)
        if u.completion_tokens > 1 and t.mean_tpot_ms > 0:
            self.tpot_ms = self._ewma(self.tpot_ms, t.mean_tpot_ms)

    def ttft_ms(self, queued_tokens: int, own_tokens: int) -> float | None:
        if self.prefill_tokens_per_ms is None:
            return None
        return (queued_tokens + own_tokens) / self.prefill_tokens_per_ms

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ALPHA) * old + self.ALPHA * new


class ColocatedBackend(GenerationBackend):
    def __init__(self, engine: Engine, model_id: str, max_waiting: int = 256) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model = ModelInfo(model_id, engine.max_model_len, engine.model_config.vocab_size)
        self.max_waiting = max_waiting
        self.predictor = LoadPredictor()
        self.loop = EngineLoop(engine)
        self._streams: dict[str, _Stream] = {}  # only touched on the event loop
        self._started = False

    @property
    def steps(self) -> int:
        """Engine steps started (a step in flight counts)."""
        return self.loop.steps

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.loop.start()
        self._started = True

    async def stop(self) -> None:
        await asyncio.to_thread(self.loop.stop)
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(ServiceUnavailableError("the server is shutting down"))

    def ready(self) -> bool:
        return self._started and self.loop.alive

    def stats(self) -> BackendStats:
        waiting = sum(1 for s in list(self._streams.values()) if not s.started)
        total = len(self._streams)
        pool = self.engine.pool
        return BackendStats(total - waiting, waiting, pool.num_free(), pool.num_blocks, self.steps)

    # ------------------------------------------------------------------ requests

    async def generate(self, inp: GenerationInput) -> AsyncIterator[TokenChunk]:
        request_id, stream = self._open(inp)
        finished = False
        try:
            while not finished:
                chunk = await self._next(stream, inp.deadline)
                stream.started = True
                if chunk.end is not None:
                    finished = True
                    self.predictor.observe(chunk.end)
                yield chunk
        finally:
            if not finished:  # cancelled, deadline, disconnect or error: free its KV now
                self.loop.unwatch(request_id)
                self.engine.abort(request_id)
                self.loop.wake()
            self._streams.pop(request_id, None)

    def _open(self, inp: GenerationInput) -> tuple[str, _Stream]:
        """Admission checks, then the request enters the engine's inbox."""
        if not self.ready():
            failure = self.loop.failure
            raise ServiceUnavailableError("the engine is not running" if failure is None
                                          else f"the engine failed: {failure}")
        self._admit(inp)
        request_id = inp.request_id or f"req-{uuid.uuid4().hex[:16]}"
        if request_id in self._streams:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use by a running request")
        stream = _Stream(self.loop.watch_async(request_id), len(inp.prompt_ids))
        self._streams[request_id] = stream
        try:
            self.engine.add_request(inp.prompt_ids, inp.params, request_id=request_id,
                                    cache_salt=inp.cache_salt, priority=inp.priority)
        except BaseException:
            self.loop.unwatch(request_id)
            self._streams.pop(request_id, None)
            raise
        self.loop.wake()
        return request_id, stream

    def _admit(self, inp: GenerationInput) -> None:
        pending = [s.prompt_tokens for s in self._streams.values() if not s.started]
        ttft = self.predictor.ttft_ms(sum(pending), len(inp.prompt_ids))
        drain_s = (ttft or 1000.0) / 1e3
        if len(pending) >= self.max_waiting:
            raise OverloadedError(f"{len(pending)} requests are waiting for their first token "
                                  f"(limit {self.max_waiting}); retry later", drain_s)
        slo = inp.slo
        tbt = self.predictor.tpot_ms
        ttft_miss = slo.ttft_ms is not None and ttft is not None and ttft > slo.ttft_ms
        tbt_miss = slo.tbt_ms is not None and tbt is not None and tbt > slo.tbt_ms
        if ttft_miss or tbt_miss:
            prediction = SloPrediction(ttft or 0.0, tbt or 0.0, slo.ttft_ms or 0.0, slo.tbt_ms or 0.0)
            raise SloMissError(prediction, drain_s)

    async def _next(self, stream: _Stream, deadline: float | None) -> TokenChunk:
        try:
            if deadline is None:
                item = await stream.queue.get()
            else:
                async with asyncio.timeout_at(deadline):  # loop.time() is time.monotonic()
                    item = await stream.queue.get()
        except TimeoutError:
            raise DeadlineExceededError("the request's deadline passed; its work was stopped") from None
        if isinstance(item, ServiceUnavailableError):
            raise item
        if isinstance(item, BaseException):  # the engine loop failed under this request
            raise ServiceUnavailableError(f"the engine failed: {item}") from item
        return item

