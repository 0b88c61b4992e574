"""The disaggregated backend: routes each request across prefill and decode workers.

```
ClusterBackend.generate(input)
  1. block hashes -> one index lookup -> per prefill worker: prefix match (own device, node's host/disk)
  2. route (Mooncake Algorithm 1): prefill = min(queue + prefill(new, cached) + fetch), decode =
     min predicted TBT with room -> admission (conductor/admission.py) on the Conductor's ledgers
     of both workers: rejected = 429 / RESOURCE_EXHAUSTED with the predictions; admitted =
     booked in both ledgers (the decode worker's KV blocks for prompt + max_tokens included)
  3. decode.reserve(id, prompt, max_tokens) -> KVHandoff(address, prompt blocks)
  4. prefill.prefill(PrefillTask)   ||   decode.generate(DecodeTask): waits for every layer,
     then streams TokenChunks
  5. cancel / deadline / disconnect: decode.cancel + prefill.abort (reservation freed either way)
```

The workers are reached only through the protocols of `core.messages` (`PrefillApi`,
`DecodeApi`); a `WorkerGroup` runs them — Ray actors in production (conductor/ray_workers.py),
the same classes in one process in tests.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from halfmoon.conductor.adapters import AdapterRegistry
from halfmoon.conductor.admission import AdmissionConfig
from halfmoon.conductor.admission_window import AdmissionWindow, SecondLook
from halfmoon.conductor.admission_stats import AdmissionStats, TopGaps
from halfmoon.conductor.backend import BackendStats, WorkerView, GenerationBackend, GenerationInput
from halfmoon.conductor.cluster_config import ClusterConfig
from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.dispatch import Ask, Booking, DecodeSide, Dispatcher, PrefillSide, PrefixMatch
from halfmoon.conductor.errors import OverloadedError, RetryableRejection, ServiceUnavailableError
from halfmoon.conductor.migration import Progress
from halfmoon.conductor.planner import Traffic, met_slo
from halfmoon.conductor.planner_loop import AdvisorFactory, PlannerLoop, start_planner
from halfmoon.conductor.rebalance import Rebalancer, WorkerDrainedError
from halfmoon.conductor.profile_cache import worker_cost_model
from halfmoon.conductor.request_names import RequestNames
from halfmoon.conductor.startup_probe import measured_overhead
from halfmoon.conductor.router import NoWorkerAvailableError
from halfmoon.conductor import spans
from halfmoon.conductor.workers import PING_TIMEOUT_S, Worker, WorkerGroup
from halfmoon.core.messages import (
    DecodeCapacityError,
    DecodeTask,
    EngineInfo,
    KVHandoff,
    KVTransferFailedError,
    PrefillResult,
    PrefillTask,
    SloPrediction,
    TokenChunk,
    WorkerLostError,
)
from halfmoon.core.adapters import AdapterRef, InvalidAdapterError
from halfmoon.core.tracing import now_ns, start_tracing
from halfmoon.engine.worker import tokenizer_for_model
from halfmoon.results import ModelInfo
from halfmoon.kvpool.block_hash import block_hashes, root_hash
from halfmoon.kvpool.cluster_index import ClusterIndex, HolderId

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0
TRAFFIC_KEEP_S = 900.0  # the requests the planner may replay (its window is at most this)
MIGRATION_POLL_S = 0.1  # how often a moving request looks for live workers


@dataclass(frozen=True, slots=True)
class Route:
    """An admitted request's workers and its booking (objectives, predictions, ledgers)."""

    prefill: Worker
    decode: Worker
    booking: Booking


class ClusterBackend(GenerationBackend):
    """The Conductor's backend over the prefill and decode workers (see the module docstring)."""

    def __init__(self, config: ClusterConfig, redis_url: str | None, workers: WorkerGroup | None = None,
                 admission: AdmissionConfig | None = None, overhead_probes: Sequence[int] = (),
                 advisor: AdvisorFactory | None = None) -> None:
        """`overhead_probes`: prompt lengths of lone requests sent at start to measure the
        per-request overhead (conductor/startup_probe.py; `halfmoon serve` sends PROBE_PROMPTS;
        none: the cost model's own, 0 unless its file sets it). `advisor`: makes the planner's
        advisor once the cost model is known (the simulator's: sim/advisor.py; needed unless
        `config.planner.mode` is off)."""
        from halfmoon.conductor.ray_workers import RayWorkers

        self.config = config
        self.overhead_probes = tuple(overhead_probes)
        self.admission_config = admission or AdmissionConfig()
        self.priority_classes = frozenset(self.admission_config.classes())
        self.dispatcher: Dispatcher | None = None  # route + admission + booking, once the cost model is known
        # arrivals held admit_window_ms, then decided shortest prefill first (on this event loop)
        self.window = AdmissionWindow(self.admission_config.admit_window_ms,
                                      lambda delay, fn: asyncio.get_running_loop().call_later(delay, fn))
        self.admission_stats = AdmissionStats()
        self.redis_url = redis_url
        self.manager: WorkerGroup = workers if workers is not None else RayWorkers(config)
        self.tracer = start_tracing(config.tracing, "conductor", "conductor")
        self.tokenizer = tokenizer_for_model(config.engine.model)
        self.cost: CostModel | None = None
        self.advisor = advisor
        self.planner: PlannerLoop | None = None  # conductor/planner_loop.py, once started
        self.rebalancer = Rebalancer(self)  # the planner's moves (conductor/rebalance.py)
        self.traffic = Traffic(TRAFFIC_KEEP_S)  # what the planner replays
        self.index: ClusterIndex | None = None
        self.info: EngineInfo | None = None
        self.worker_infos: tuple[EngineInfo, ...] = ()
        self._health: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()  # fire-and-forget cancels, kept referenced
        self._requests = 0  # attempts in flight
        self.names = RequestNames()  # client ids running, and each attempt's name on the workers
        self._streaming = 0  # of which past their first token
        self._reruns: collections.Counter[str] = collections.Counter()  # see BackendStats.requests_rerun
        self._reprefilled = 0  # prompt tokens sent to prefill again by re-runs and moves
        # LoRA adapters: checked against the workers' shapes, known at start
        self.adapters = AdapterRegistry(config.model_id, None, config.engine.max_lora_rank,
                                        f"LoRA adapters are not served with tensor-parallel workers "
                                        f"(--prefill-tp {config.prefill_tp}, --decode-tp {config.decode_tp})")

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await asyncio.to_thread(self.manager.start, self.redis_url)
        first = self.manager.role("prefill")[0]
        self.info = await first.api.engine_info()
        everyone = self.manager.role("prefill") + self.manager.role("decode")  # where each computes (the planner's)
        self.worker_infos = tuple(await asyncio.gather(*(w.api.engine_info() for w in everyone)))
        self.model = ModelInfo(self.config.model_id, self.info.max_model_len, self.info.vocab_size,
                               architecture=self.info.architecture, dtype=self.info.dtype)
        self.block_size = self.info.block_size
        self.adapters.base_id = self.config.model_id
        self.adapters.shapes = self.info.lora if self.config.decode_tp == 1 else None
        self.adapters.max_rank = self.info.max_lora_rank
        self.cost = await self._cost_model(first)
        self._dispatch_with(self.cost, self.admission_stats)
        if self.redis_url is not None:
            # Started: a holder that never beats expires and re-registers on its next lookup.
            self.index = ClusterIndex(self.redis_url, HolderId("conductor", "conductor")).start()
        await self.manager.check_health()
        self.learn_capacity()
        if self.overhead_probes and not self.cost.overhead_ms:
            # the probes decide on a Conductor of their own: counted nowhere, calibrating nothing
            self._dispatch_with(self.cost, AdmissionStats())
            self.cost = await measured_overhead(self.generate, self.cost, self.info.vocab_size,
                                                self.admission_config.admit_window_ms, self.overhead_probes)
            self._dispatch_with(self.cost, self.admission_stats)
        self._health = asyncio.create_task(self._health_loop())
        self.planner = start_planner(self, self.advisor) if self.config.planner.mode != "off" else None

    def _dispatch_with(self, cost: CostModel, stats: AdmissionStats) -> None:
        assert self.info is not None
        self.dispatcher = Dispatcher(self.admission_config, cost, self.info.block_size, stats=stats,
                                     prefill_budget=self.config.engine.max_num_batched_tokens,
                                     prefill_max_seqs=self.config.prefill_seqs("prefill"))

    def learn_capacity(self) -> None:
        """The largest request (prompt + max_tokens) a decode worker's KV holds: more is a 400."""
        assert self.info is not None
        blocks = max((w.total_blocks for w in self.manager.role("decode")), default=0)
        if blocks:
            self.kv_capacity_tokens = blocks * self.info.block_size

    async def _cost_model(self, first: Worker) -> CostModel:
        """The given cost model, else the cached profile of this worker shape, else the first
        prefill worker's quick profile (then cached: conductor/profile_cache.py); with decode
        workers of another tensor-parallel size, their decode steps from the first one's."""
        if self.config.cost_model is not None:
            return CostModel.load(self.config.cost_model)
        assert self.info is not None
        prefill = await worker_cost_model(first, self.info)
        if self.config.prefill_tp == self.config.decode_tp:
            return prefill
        # tensor-parallel layouts that differ: decode steps as the decode workers take them
        decode = self.manager.role("decode")[0]
        return prefill.with_decode_of(await worker_cost_model(decode, await decode.api.engine_info()))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            await self.manager.check_health()

    async def stop(self) -> None:
        if self.planner is not None:
            await self.planner.stop()
        if self._health is not None:
            self._health.cancel()
        self.manager.stop_warm_ups()
        if self.index is not None:
            self.index.close()
        await asyncio.to_thread(self.manager.stop)
        self.tracer.shutdown()

    def degraded(self) -> list[str]:
        reasons = []
        if self.index is not None and not self.index.healthy:
            reasons.append(f"cluster index: Redis at {self.redis_url} is unreachable; prefixes are found in each "
                           "worker's own cache only until it is back (re-synced then, no restart needed)")
        down = sorted(w.worker_id for w in self.manager.workers.values() if not w.alive)
        if down and self.ready():
            reasons.append(f"workers down (being restarted; requests go to the others): {', '.join(down)}")
        return reasons

    def standbys(self) -> list[dict[str, str]]:
        return [{"id": w.worker_id, "role": w.spec.role, "state": w.state} for w in self.manager.everyone()
                if w.state != "ready"]

    def ready(self) -> bool:
        workers = self.manager.workers.values()
        return any(w.alive for w in workers if w.spec.role == "prefill") and \
            any(w.alive for w in workers if w.spec.role == "decode")

    def stats(self) -> BackendStats:
        decode = self.manager.role("decode")
        free = sum(w.free_blocks for w in decode)
        total = sum(w.total_blocks for w in decode)
        depth = {w.worker_id: w.pending.depth if w.spec.role == "prefill" else len(w.bound.jobs)
                 for w in self.manager.workers.values()}
        health = {w.worker_id: w.index_health for w in self.manager.everyone()}
        if self.index is not None:
            health["conductor"] = (self.index.stats.max_heartbeat_gap_s, self.index.stats.resyncs)
        views = tuple(WorkerView(w.worker_id, w.spec.role, w.alive, w.restarts, depth.get(w.worker_id, 0), w.load,
                                 w.load_at, tuple(w.history), w.state, w.pid) for w in self.manager.everyone())
        index = self.index
        return BackendStats(self._streaming, self._requests - self._streaming, free, total, 0,
                            dict(self._reruns), depth, self.admission_stats, health, views,
                            None if index is None else index.healthy, 0 if index is None else index.stats.redis_errors,
                            self._reprefilled, self.adapters.snapshot(),
                            None if self.planner is None else self.planner.snapshot())

    async def prepare_adapter(self, adapter: AdapterRef) -> None:
        """Every live worker reads `adapter` now (its first request then reads nothing); a worker
        that cannot (the folder is not on its node, say) refuses the load, named."""
        live = [w for w in self.manager.workers.values() if w.alive]
        results = await asyncio.gather(*(w.api.load_adapter(adapter) for w in live), return_exceptions=True)
        for worker, result in zip(live, results):
            if isinstance(result, InvalidAdapterError):
                raise InvalidAdapterError(adapter.name, f"worker {worker.worker_id}: {result.reason}")
            if isinstance(result, BaseException):
                log.warning("worker %s did not read adapter %s ahead (%s): it reads it at its first request",
                            worker.worker_id, adapter.name, result)

    # ------------------------------------------------------------------ requests

    async def generate(self, inp: GenerationInput) -> AsyncIterator[TokenChunk]:
        """Route and run. When a worker dies under the request or its KV transfer fails, the
        request moves (conductor/migration.py): before its first token it runs again; after it,
        it is re-admitted with its prompt + the tokens already sent and goes on from there on a
        live or restarted pair of workers; the client sees a pause, not an error. At most
        `migration_attempts` moves, waiting at most `migration_stall_s` in all for live workers
        (a new request finding every worker of a role down waits the same way); past either,
        UNAVAILABLE naming the cause."""
        rid = self.names.claim(inp.request_id)
        self.traffic.arrived(rid, time.monotonic(), len(inp.prompt_ids), inp.params.max_tokens)
        try:
            async with aclosing(self._moves(inp, rid)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self.names.release(rid)

    async def _moves(self, inp: GenerationInput, rid: str) -> AsyncIterator[TokenChunk]:
        """`generate` for the client id `rid`: its tries, each under a fresh name on the workers."""
        progress = Progress(inp, time.perf_counter())
        stall_left = self.config.migration_stall_s
        for attempt in itertools.count(1):
            # A fresh name per attempt: the workers may still be cleaning up the last one.
            wid = self.names.inner(rid)
            try:
                if progress.left <= 0:  # every token reached the client; only the end was lost
                    yield progress.complete_end(rid)
                    return
                async with aclosing(self._attempt(progress.next_input(), rid, wid, progress.arrival,
                                                  resumed=bool(progress.sent))) as items:
                    async for item in items:
                        yield progress.forward(item)
                return
            except (WorkerLostError, KVTransferFailedError) as e:
                if progress.sent and inp.params.n > 1:  # its choices' tokens are not one continuation
                    raise ServiceUnavailableError(f"{e}; request {rid} has n = {inp.params.n} choices under way: "
                                                  "such a request is re-run before its first token, never moved "
                                                  "after it") from e
                if attempt > self.config.migration_attempts:
                    raise ServiceUnavailableError(f"{e}; request {rid} gave up after {attempt - 1} moves "
                                                  "(--migration-attempts)") from e
                cause = "worker_lost" if isinstance(e, WorkerLostError) else "kv_transfer"
                inp.span.event("halfmoon.rerun", {"halfmoon.cause": cause, "halfmoon.attempt": attempt + 1})
                self._reruns["migrated" if progress.sent else cause] += 1
                self._reprefilled += len(inp.prompt_ids) + len(progress.sent)  # the next attempt's prompt
                progress.moves += bool(progress.sent)
                if progress.sent:
                    log.warning("request %s: %s after %d tokens; moving it (attempt %d)", rid, e,
                                len(progress.sent), attempt + 1)
                else:
                    log.warning("request %s: %s before its first token; re-running it", rid, e)
                stall_left -= await self._await_live_pair(rid, stall_left)
            except NoWorkerAvailableError as e:
                # Every worker of a role is down (being restarted): the request waits for one as a
                # moving request does, within the same --migration-stall-s (found by the soak).
                if stall_left <= 0:
                    raise ServiceUnavailableError(f"{e}; request {rid} waited {self.config.migration_stall_s:g} s "
                                                  "(--migration-stall-s)") from e
                await asyncio.sleep(MIGRATION_POLL_S)  # the health loop's verdicts, polled
                stall_left -= MIGRATION_POLL_S + await self._await_live_pair(rid, stall_left)

    async def _await_live_pair(self, rid: str, budget_s: float) -> float:
        """Wait (up to `budget_s`) until a live prefill and a live decode worker exist (the health
        loop marks a restarted worker alive); the seconds waited. Past the budget: UNAVAILABLE."""
        start = time.monotonic()

        def live(role: str) -> bool:
            return any(w.alive for w in self.manager.role(role))

        while not (live("prefill") and live("decode")):
            if time.monotonic() - start >= budget_s:
                raise ServiceUnavailableError(f"request {rid}: no live prefill and decode worker to move it to "
                                              f"within {self.config.migration_stall_s:g} s (--migration-stall-s)")
            await asyncio.sleep(MIGRATION_POLL_S)  # the health loop's verdicts, polled
        return time.monotonic() - start

    async def _attempt(self, inp: GenerationInput, rid: str, wid: str, arrival: float,
                       resumed: bool = False) -> AsyncIterator[TokenChunk]:
        """One try on one prefill/decode pair; `wid` names the request on the workers; `resumed`:
        a request moving after its first token (admitted once already; its measurements do not
        train the predictions)."""
        route = await self._route(inp, wid, resumed)
        p, d, bound = route.prefill, route.decode, route.booking.bound
        self._requests += 1
        finished = False
        first_at: float | None = None
        gaps = TopGaps(inp.params.max_tokens)
        try:
            prefill_done = await self._start(inp, wid, route)
            task = DecodeTask(wid, inp.prompt_ids, inp.params, inp.cache_salt, self.config.request_timeout_s,
                              self.manager.block_servers(), inp.span.traceparent)
            async with aclosing(self._decoded(d, d.api.generate(task), prefill_done)) as chunks:  # type: ignore[union-attr]
                async for chunk in chunks:
                    now = time.perf_counter()
                    if first_at is None:
                        first_at = now
                        self._streaming += 1
                    gaps.tick(now, len(chunk.token_ids))
                    bound.generated += len(chunk.token_ids)
                    if chunk.end is None:
                        yield chunk if chunk.request_id == rid else replace(chunk, request_id=rid)
                        continue
                    finished = True
                    last = self._last(rid, chunk, await prefill_done, len(inp.prompt_ids), arrival, first_at,
                                      route.booking.decision.prediction)
                    last = replace(last, end=replace(last.end, prefill_worker=p.worker_id,  # type: ignore[arg-type]
                                                     decode_worker=d.worker_id))
                    if not resumed:
                        self._measured(route, inp, last, gaps)
                    yield last
                    return
            raise ServiceUnavailableError(f"request {rid}: the decode stream ended without a result")
        finally:
            self._requests -= 1
            self._streaming -= first_at is not None
            p.pending.finish(wid, time.monotonic())
            d.bound.release(wid)
            if not finished:
                self._spawn(d.api.cancel(wid))  # type: ignore[union-attr]
                self._spawn(p.api.abort(wid))  # type: ignore[union-attr]

    async def _reserve(self, inp: GenerationInput, wid: str, route: Route) -> KVHandoff:
        """The decode side's blocks for the prompt + max_tokens; a refusal there is load (429)."""
        d = route.decode
        reserving = now_ns()
        try:
            handoff = await self._on(d, d.api.reserve(wid, len(inp.prompt_ids), inp.params.max_tokens,  # type: ignore[union-attr]
                                                      self.config.request_timeout_s))
        except DecodeCapacityError as e:  # the ledger and the worker disagree for a moment: load, not failure
            self.admission_stats.rejected(route.booking.objective.slo_class.name, "kv_capacity")
            raise OverloadedError(f"decode worker {d.worker_id}: {e}", 1.0, "kv_capacity",
                                  route.booking.decision.prediction) from e
        spans.reserve(self.tracer, inp.span, reserving, d.worker_id, len(handoff.block_ids))
        return handoff

    async def _start(self, inp: GenerationInput, wid: str, route: Route) -> asyncio.Future:
        """Reserve the decode side's blocks (prompt + max_tokens), then start the prefill; its
        future. A prefill that fails (worker died, push failed) stops the decode side's wait at
        once; one that ends lets the decode ledger know the request joined."""
        p, d = route.prefill, route.decode
        turn = p.sends.take()  # the prefill worker hears of it in decision order (core/turns.py)
        try:
            handoff = await self._reserve(inp, wid, route)
            task = PrefillTask(wid, inp.prompt_ids, inp.params, inp.cache_salt, handoff, self.config.request_timeout_s,
                               self.manager.block_servers(), route.booking.objective.rank, route.booking.deadline,
                               inp.span.traceparent, route.booking.fetch_from)
            await p.sends.wait(turn)
            prefill_done = asyncio.ensure_future(self._on(p, p.api.prefill(task)))  # type: ignore[union-attr]
        finally:
            p.sends.done(turn)

        def on_prefill_end(f: asyncio.Future) -> None:
            p.pending.finish(wid, time.monotonic())
            route.booking.bound.joins_at = time.monotonic()
            self.window.relook()  # the queue ahead of a kept request shrank (conductor/admission_window.py)
            if not f.cancelled() and f.exception() is not None:
                self._spawn(d.api.cancel(wid))  # type: ignore[union-attr]

        prefill_done.add_done_callback(on_prefill_end)
        return prefill_done

    async def _decoded(self, d: Worker, stream: AsyncIterator[TokenChunk],
                       prefill_done: asyncio.Future) -> AsyncIterator[TokenChunk]:
        """The decode stream's chunks; if it fails, the prefill's error (when it failed first) is
        the one to report: the decode side often notices a dead prefill worker (its KV
        connection closed) before the prefill's outcome arrives, so that gets a moment."""
        try:
            async for chunk in self._on_stream(d, stream):
                yield chunk
        except (ServiceUnavailableError, WorkerLostError, KVTransferFailedError):
            await asyncio.wait({prefill_done}, timeout=PING_TIMEOUT_S)
            if prefill_done.done() and not prefill_done.cancelled() and prefill_done.exception() is not None:
                raise prefill_done.exception() from None
            raise

    async def _on_stream(self, worker: Worker, stream: AsyncIterator[TokenChunk]) -> AsyncIterator[TokenChunk]:
        """`stream`'s chunks, its failures mapped as `_on` maps them."""
        try:
            while True:
                try:
                    chunk = await self._on(worker, anext(stream))
                except StopAsyncIteration:
                    return
                yield chunk
                if worker.worker_id in self.rebalancer.evicting:  # leaving its pool: the request moves
                    raise WorkerDrainedError(worker.worker_id)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def _on(self, worker: Worker, call: Coroutine[Any, Any, Any]) -> Any:
        """Await a worker's answer. A lost worker or a failed KV transfer is raised as it is (the
        request may run again); any other failure of the worker is UNAVAILABLE (nothing was
        lost: the request's reservation is freed by `cancel`)."""
        try:
            return await call
        except WorkerLostError:
            worker.alive = False
            self.manager.promote(worker)  # a standby takes its place now: the move below finds it
            raise
        except (KVTransferFailedError, StopAsyncIteration):
            raise
        except Exception as e:  # the worker's own error (over Ray: any exception it raised)
            raise ServiceUnavailableError(f"worker {worker.worker_id}: {e}") from e

    def _spawn(self, call: Coroutine[Any, Any, Any]) -> None:
        """Run `call` in the background (a cancel or abort nobody waits for); failures are logged."""
        task = asyncio.ensure_future(call)
        self._background.add(task)
        task.add_done_callback(self._reap)

    def _reap(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("background worker call failed: %s", task.exception())

    @staticmethod
    def _last(rid: str, chunk: TokenChunk, pre: PrefillResult, n_prompt: int, arrival: float,
              first_at: float, prediction: SloPrediction) -> TokenChunk:
        """The last chunk, its end as the client sees it: prefill figures from the prefill
        worker, TTFT and e2e measured here, TPOT from the decode worker, admission's prediction."""
        end = chunk.end
        assert end is not None
        now = time.perf_counter()
        usage = replace(end.usage, prompt_tokens=n_prompt, cached_prompt_tokens=pre.num_cached_tokens)
        timings = replace(end.timings, queue_ms=pre.queue_ms, prefill_ms=pre.prefill_ms, transfer_ms=pre.push_ms,
                          ttft_ms=(first_at - arrival) * 1e3, e2e_ms=(now - arrival) * 1e3)
        return replace(chunk, request_id=rid, end=replace(end, usage=usage, timings=timings, prediction=prediction))

    def _measured(self, route: Route, inp: GenerationInput, last: TokenChunk, gaps: TopGaps) -> None:
        """An admitted request finished: what it generated and how far off the predictions were."""
        assert last.end is not None and self.dispatcher is not None
        self.dispatcher.finished(route.booking, last.end.usage.completion_tokens // inp.params.n, inp.params.max_tokens,
                                 last.end.timings.ttft_ms / 1e3, gaps.mean_s())
        self.traffic.ended(last.request_id, last.end.usage.completion_tokens // inp.params.n,
                           met_slo(route.booking.objective, last.end.timings.ttft_ms, gaps.mean_s()))

    # ------------------------------------------------------------------ routing

    async def _route(self, inp: GenerationInput, wid: str, resumed: bool) -> Route:
        """The index's prefix match, then `_admit`; traced as the request's admission span."""
        started, arrival = now_ns(), time.monotonic()
        # Hashing the prompt and the index round trip run off the event loop: a slow or hung
        # Redis (up to the index's socket timeout) must not stall every other stream.
        prefix = await asyncio.to_thread(self.prefix_match, inp.prompt_ids, inp.cache_salt, inp.params.adapter)
        policy = self.admission_config.admission
        try:
            route = await self._held(inp, wid, prefix, resumed, arrival)  # decision + booking at once
        except RetryableRejection as e:
            spans.admission(self.tracer, inp.span, started, policy, e)
            self.traffic.ended(wid.rsplit("@", 1)[0], 0, met=False, rejected=True)
            raise
        spans.admission(self.tracer, inp.span, started, policy, route.booking)
        return route

    async def _held(self, inp: GenerationInput, wid: str, prefix: PrefixMatch, resumed: bool,
                    arrival: float) -> Route:
        """`_admit` when the admission window next decides (conductor/admission_window.py); a
        resumed request (admitted once already) at once. Cancelled while held, it books nothing;
        cancelled once booked, its bookings are released."""
        assert self.dispatcher is not None
        if resumed or self.window.window_ms <= 0:
            return self._admit(inp, wid, prefix, resumed)
        future: asyncio.Future[Route] = asyncio.get_running_loop().create_future()

        def decide(final: bool) -> None:
            if future.done():  # cancelled while held: nothing to decide
                return
            try:
                future.set_result(self._admit(inp, wid, prefix, resumed, arrival, final))
            except SecondLook:  # kept by the window for another look
                raise
            except Exception as e:  # the rejection (or no worker): the request's own error
                future.set_exception(e)

        ask = Ask(wid, len(inp.prompt_ids), inp.params.max_tokens, inp.priority_class, inp.slo,
                  choices=inp.params.n)
        self.window.hold(*self.dispatcher.window_key(ask, prefix), decide)
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                route = future.result()  # booked, then its caller went away
                route.prefill.pending.finish(wid, time.monotonic())
                route.decode.bound.release(wid)
            raise

    def _admit(self, inp: GenerationInput, wid: str, prefix: PrefixMatch, resumed: bool = False,
               arrival: float | None = None, final: bool = True) -> Route:
        """Route (Mooncake Algorithm 1 over the live workers, given the index's `prefix_match`),
        decide admission on the chosen workers' ledgers, and book the request in both
        (conductor/dispatch.py; all on the event loop, so no other request sees the ledgers in
        between). A `resumed` request is refused only for want of KV room."""
        assert self.dispatcher is not None
        prefill = [PrefillSide(w.worker_id, w.pending, w.alive) for w in self.manager.role("prefill")]
        decode = [DecodeSide(w.worker_id, w.bound, w.alive) for w in self.manager.role("decode")]
        ask = Ask(wid, len(inp.prompt_ids), inp.params.max_tokens, inp.priority_class, inp.slo, resumed,
                  inp.params.n)
        booking = self.dispatcher.dispatch(ask, prefix, prefill, decode, time.monotonic(), arrival, final)
        p, d = self.manager.workers[booking.prefill_id], self.manager.workers[booking.decode_id]
        return Route(p, d, booking)

    def prefix_match(self, prompt_ids: list[int], cache_salt: str | None,
                     adapter: AdapterRef | None = None) -> PrefixMatch:
        """What the cluster index knows of this prompt's blocks (nothing without an index)."""
        adapter_ms = self._adapter_ms(adapter)
        if self.index is None or self.info is None:
            return PrefixMatch({}, adapter_ms=adapter_ms)
        bs = self.info.block_size
        root = root_hash(self.info.fingerprint, self.info.dtype, bs, cache_salt,
                         adapter.cache_key if adapter is not None else "")
        result = self.index.lookup(block_hashes(prompt_ids, bs, root))
        matched: dict[str, int] = {}
        prefill = self.manager.role("prefill")
        for m in result.matches:
            # Host/disk tiers are shared by the workers of one node: a match there counts for
            # every prefill worker on the holder's node (a worker on another node must fetch it).
            shared = m.blocks_per_tier[1] + m.blocks_per_tier[2] > 0
            for w in prefill:
                if w.worker_id == m.holder.worker_id or (shared and w.node_id == m.holder.node_id):
                    matched[w.worker_id] = max(matched.get(w.worker_id, 0), m.length * bs)
        # Of the longest matches, a prefill worker's: a decode worker serves blocks between its
        # decode steps, so reading from it would stretch its streams' token gaps.
        prefill_ids = {w.worker_id for w in prefill}
        best = max(result.matches, key=lambda m: (m.length, m.holder.worker_id in prefill_ids), default=None)
        if best is None or not self.config.engine.remote_fetch:  # local-only: no pull to price
            return PrefixMatch(matched, adapter_ms=adapter_ms)
        return PrefixMatch(matched, best.length * bs, best.holder.worker_id, adapter_ms)

    def _adapter_ms(self, adapter: AdapterRef | None) -> dict[str, float]:
        """Per prefill worker that does not hold `adapter` (its last health answer), the time to
        read it there: what reading and checking it took the Conductor."""
        if adapter is None:
            return {}
        cost = self.adapters.load_ms(adapter.name)
        return {w.worker_id: cost for w in self.manager.role("prefill")
                if w.load is None or adapter.digest not in w.load.adapters}

