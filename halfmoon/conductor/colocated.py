"""The co-located backend: one engine in this process, stepped by one thread.

```
event loop (gRPC + HTTP handlers)            engine thread (engine/loop.py)
  generate(): watch_async(id@n), add_request -> engine.step() ... outputs
  await queue.get()  <-- call_soon_threadsafe -- one put per request per step
  closed early -> engine.abort(id@n)  ------>  freed at the start of the next step
```

The engine knows each request as `{id}@{n}` (conductor/request_names.py): the client's id is free
again the moment its stream closes, though the engine frees a cancelled one a step later.

Admission is the cluster's (conductor/admission.py) over this engine: requests waiting for their
first token are its prefill queue, requests decoding its decode batch, and a prefill's chunk
stretches the steps of everything decoding meanwhile (`Admission(colocated_chunk=...)`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace

from halfmoon.conductor.adapters import AdapterRegistry
from halfmoon.conductor.admission import AdmissionConfig
from halfmoon.conductor.admission_stats import AdmissionStats, TopGaps
from halfmoon.conductor.backend import BackendStats, GenerationBackend, GenerationInput, WorkerView
from halfmoon.conductor.cost_model import CostModel, profile_engine
from halfmoon.conductor.dispatch import COLOCATED, Ask, Booking, Dispatcher
from halfmoon.conductor.errors import DeadlineExceededError, RetryableRejection, ServiceUnavailableError
from halfmoon.conductor.ledger import DecodeLedger, PrefillLedger
from halfmoon.conductor.profile_cache import cached_cost_model, profile_key
from halfmoon.conductor.request_names import RequestNames
from halfmoon.conductor import spans
from halfmoon.core.adapters import AdapterRef
from halfmoon.core.messages import Timings, TokenChunk
from halfmoon.core.tracing import NO_TRACER, Span, Tracer, now_ns
from halfmoon.engine.engine import Engine
from halfmoon.engine.loop import EngineLoop
from halfmoon.engine.worker import engine_load
from halfmoon.results import ModelInfo

_Item = TokenChunk | BaseException


@dataclass(slots=True)
class _Stream:
    queue: asyncio.Queue[_Item]
    booking: Booking
    gaps: TopGaps
    added_ns: int  # when it entered the engine (its trace's time base)
    started: bool = False  # first token seen


class ColocatedBackend(GenerationBackend):
    mode = "colocated"

    def __init__(self, engine: Engine, model_id: str, max_waiting: int = 256,
                 admission: AdmissionConfig | None = None, cost_model: CostModel | None = None,
                 tracer: Tracer = NO_TRACER) -> None:
        """`cost_model`: None = the cached profile of this engine shape, else a quick profile at
        start (conductor/profile_cache.py). `tracer`: this process's (role colocated)."""
        self.engine = engine
        self.tracer = tracer
        self.tokenizer = engine.tokenizer
        self._grammars = engine.grammars  # one cache: the front door's check compiles for the engine
        self.model = ModelInfo(model_id, engine.max_model_len, engine.model_config.vocab_size,
                               architecture=engine.model_config.architecture, dtype=engine.config.kv_tag)
        info = engine.info()
        self.adapters = AdapterRegistry(model_id, info.lora, info.max_lora_rank,
                                        f"LoRA adapters are not served by tensor-parallel engines (tp = {engine.config.tp})")
        # One bound on the queue: --max-waiting is this mode's name for max_queue_per_worker.
        cfg = admission or AdmissionConfig()
        self.admission_config = replace(cfg, max_queue_per_worker=min(cfg.max_queue_per_worker, max_waiting))
        self.priority_classes = frozenset(self.admission_config.classes())
        self.kv_capacity_tokens = engine.pool.num_blocks * engine.config.block_size
        self.block_size = engine.config.block_size
        self.cost = cost_model
        self.dispatcher: Dispatcher | None = None  # admission + booking, once the cost model is known
        self.admission_stats = AdmissionStats()
        self.pending = PrefillLedger()  # waiting for their first token
        self.bound = DecodeLedger(engine.pool.num_blocks)  # every request in the engine
        self.loop = EngineLoop(engine)
        self._streams: dict[str, _Stream] = {}  # by engine-side name; only touched on the event loop
        self.names = RequestNames()
        self._started = False

    @property
    def steps(self) -> int:
        """Engine steps started (a step in flight counts)."""
        return self.loop.steps

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.cost is None:  # measured before the loop starts: profiling needs the engine idle
            self.cost = await self._profiled()
        self.dispatcher = Dispatcher(self.admission_config, self.cost, self.engine.config.block_size,
                                     self.engine.config.max_num_batched_tokens, self.admission_stats)
        self.loop.start()
        self._started = True

    async def _profiled(self) -> CostModel:
        engine = self.engine

        async def measure() -> CostModel:
            return await asyncio.to_thread(profile_engine, engine, quick=True)

        return await cached_cost_model(profile_key(engine.info(), engine.config), measure)

    async def stop(self) -> None:
        await asyncio.to_thread(self.loop.stop)
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(ServiceUnavailableError("the server is shutting down"))
        self.tracer.shutdown()

    def ready(self) -> bool:
        return self._started and self.loop.alive

    async def prepare_adapter(self, adapter: AdapterRef) -> None:
        """Read it into the engine's host cache now, off the event loop: the first request naming
        it would otherwise read the files on the event loop (the engine's validation loads it)."""
        await asyncio.to_thread(self.engine.load_adapter, adapter)

    def stats(self) -> BackendStats:
        waiting = self.pending.depth
        pool = self.engine.pool
        view = WorkerView("engine", "colocated", self.ready(), 0, waiting, engine_load(self.engine, self.loop),
                          time.monotonic())
        return BackendStats(len(self._streams) - waiting, waiting, pool.num_free(), pool.num_blocks, self.steps,
                            {}, {"engine": waiting}, self.admission_stats, workers=(view,),
                            lora=self.adapters.snapshot())

    # ------------------------------------------------------------------ requests

    async def generate(self, inp: GenerationInput) -> AsyncIterator[TokenChunk]:
        rid = self.names.claim(inp.request_id)
        try:
            async with aclosing(self._run(inp, rid, self.names.inner(rid))) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self.names.release(rid)

    async def _run(self, inp: GenerationInput, rid: str, inner: str) -> AsyncIterator[TokenChunk]:
        """One request in the engine as `inner`; its chunks carry the client's id `rid`."""
        stream = self._open(inp, inner)
        finished = False
        try:
            while not finished:
                chunk = await self._next(stream, inp.deadline)
                self._progress(inner, stream, chunk)
                if chunk.end is not None:
                    finished = True
                    chunk = self._finish(stream, chunk, inp)
                yield replace(chunk, request_id=rid)
        finally:
            if not finished:  # cancelled, deadline, disconnect or error: free its KV now
                self.loop.unwatch(inner)
                self.engine.abort(inner)
                self.loop.wake()
            self._streams.pop(inner, None)
            self.pending.finish(inner, time.monotonic())
            self.bound.release(inner)

    def _progress(self, request_id: str, stream: _Stream, chunk: TokenChunk) -> None:
        if not stream.started:
            stream.started = True
            self.pending.finish(request_id, time.monotonic())
            stream.booking.bound.joins_at = time.monotonic()
        stream.gaps.tick(time.perf_counter(), len(chunk.token_ids))
        stream.booking.bound.generated += len(chunk.token_ids)

    def _finish(self, stream: _Stream, chunk: TokenChunk, inp: GenerationInput) -> TokenChunk:
        """The last chunk, with admission's prediction; the prediction's error is recorded."""
        end = chunk.end
        assert end is not None and self.dispatcher is not None
        self.dispatcher.finished(stream.booking, end.usage.completion_tokens // inp.params.n, inp.params.max_tokens,
                                 end.timings.ttft_ms / 1e3, stream.gaps.mean_s())
        if inp.span.recording:
            self._trace_engine(inp.span, stream.added_ns, end.timings)
        return replace(chunk, end=replace(end, prediction=stream.booking.decision.prediction,
                                          prefill_worker=COLOCATED, decode_worker=COLOCATED))

    def _open(self, inp: GenerationInput, request_id: str) -> _Stream:
        """Admission, then the request enters the engine's inbox (booked in both ledgers)."""
        if not self.ready():
            failure = self.loop.failure
            raise ServiceUnavailableError("the engine is not running" if failure is None
                                          else f"the engine failed: {failure}")
        booking = self._admit(inp, request_id)  # booked in both ledgers
        stream = _Stream(self.loop.watch_async(request_id), booking, TopGaps(inp.params.max_tokens), now_ns())
        self._streams[request_id] = stream
        now = time.monotonic()
        try:
            self.engine.add_request(inp.prompt_ids, inp.params, request_id=request_id, cache_salt=inp.cache_salt,
                                    priority=booking.objective.rank, deadline=booking.deadline)
        except BaseException:
            self.loop.unwatch(request_id)
            self._streams.pop(request_id, None)
            self.pending.finish(request_id, now)
            self.bound.release(request_id)
            raise
        self.loop.wake()
        return stream

    def _admit(self, inp: GenerationInput, request_id: str) -> Booking:
        """Admission on this engine's ledgers (conductor/dispatch.py); raises the rejection."""
        assert self.dispatcher is not None
        n = len(inp.prompt_ids)
        cached = self.engine.cached_prefix_tokens(inp.prompt_ids, inp.cache_salt, inp.params.adapter)
        ask = Ask(request_id, n, inp.params.max_tokens, inp.priority_class, inp.slo, choices=inp.params.n)
        started, policy = now_ns(), self.admission_config.admission
        try:
            stats = self.engine.scheduler.stats  # counters read across threads: plain ints
            self.bound.observe_decode(stats.decode_entries, stats.decode_tokens, stats.decode_single)
            booking = self.dispatcher.dispatch_colocated(ask, cached, self.pending, self.bound, time.monotonic())
        except RetryableRejection as e:
            spans.admission(self.tracer, inp.span, started, policy, e)
            raise
        spans.admission(self.tracer, inp.span, started, policy, booking)
        return booking

    def _trace_engine(self, span: Span, added_ns: int, t: Timings) -> None:
        """A finished request's time in the engine, from its timings: queue, prefill, decode."""
        scheduled, first = added_ns + int(t.queue_ms * 1e6), added_ns + int(t.ttft_ms * 1e6)
        self.tracer.record("engine.queue", span, added_ns, scheduled)
        self.tracer.record("engine.prefill", span, scheduled, first)
        self.tracer.record("engine.decode", span, first, added_ns + int(t.e2e_ms * 1e6))

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

