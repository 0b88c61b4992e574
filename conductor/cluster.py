"""The disaggregated cluster: Ray actors for prefill and decode workers, and the backend that
routes each request across them.

```
ClusterBackend.generate(input)
  1. block hashes -> one index lookup -> per prefill worker: prefix match (own device, node's host/disk)
  2. route (Mooncake Algorithm 1): prefill = min(queue + prefill(new, cached) + fetch), decode =
     min predicted TBT with room -> SLO check (RESOURCE_EXHAUSTED with the predictions)
  3. decode.reserve(id, prompt) -> (KV address, blocks)
  4. prefill.prefill(task)   ||   decode.generate(task): waits for every layer, then streams tokens
  5. cancel / deadline / disconnect: decode.cancel + prefill.abort (reservation freed either way)
```

`ClusterManager` owns Ray (embedded, bounded object store, unless `ray_address`), starts the
workers with custom resources `prefill` / `decode` (so actors land on the right nodes; `num_gpus`
when CUDA is present), pins each local worker to its own cores, restarts dead actors (Ray
`max_restarts`) and tracks their health with a ping loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from conductor.backend import (BackendStats, Completion, GenerationBackend, GenerationInput,
                               ModelCard, Timings, TokenDelta, Usage)
from conductor.cost_model import CostModel, fit_profile
from conductor.errors import ServiceUnavailableError, SloMissError, SloPrediction
from conductor.router import DecodeView, PrefillView, RouteRequest, Router
from engine.config import EngineConfig
from engine.worker import WorkerSpec, tokenizer_for_model
from kvpool.block_hash import block_hashes, root_hash
from kvpool.cluster_index import ClusterIndex, HolderId
from transport.config import TransportConfig

log = logging.getLogger(__name__)

NAMESPACE = "halfmoon"
PING_TIMEOUT_S = 5.0
RAY_START_ATTEMPTS = 3  # CI saw Ray's GCS and raylet miss their own 30 s start-up waits
FETCH_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The cluster `halfmoon serve --prefill N --decode M` runs.

    worker_threads: CPU threads (and pinned cores, locally) per worker.
    ray_address: join this Ray cluster (None = start an embedded one).
    object_store_mb: the embedded Ray's object store (Ray takes 30% of RAM otherwise).
    cost_model: a `halfmoon profile` JSON; None = the first prefill worker profiles itself.
    prefill_gpus / decode_gpus: GPUs each actor asks Ray for (pass them explicitly when the
        Conductor runs on a head node without GPUs).
    request_timeout_s: bound on a request's KV transfer and prefill.
    """

    prefill: int = 1
    decode: int = 1
    engine: EngineConfig = field(default_factory=EngineConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    worker_threads: int = 1
    ray_address: str | None = None
    object_store_mb: int = 256
    cost_model: str | None = None
    request_timeout_s: float = 60.0
    model_id: str = "smollm2"
    prefill_gpus: int | None = None  # per actor; None = 1 if the Conductor's machine sees CUDA
    decode_gpus: int | None = None

    def gpus(self, role: str) -> int:
        given = self.prefill_gpus if role == "prefill" else self.decode_gpus
        return given if given is not None else int(_cuda())

    def specs(self) -> list[WorkerSpec]:
        cores = os.cpu_count() or 1
        specs = []
        for i, role in enumerate(["prefill"] * self.prefill + ["decode"] * self.decode):
            index = i if role == "prefill" else i - self.prefill
            first = (i * self.worker_threads) % cores
            cpus = tuple((first + k) % cores for k in range(self.worker_threads)) if self.ray_address is None else None
            specs.append(WorkerSpec(f"{role}-{index}", role, self.engine, self.transport, cpus))
        return specs


def block_server_of(holder: HolderId) -> str:
    """Where a holder serves its blocks (runs inside a worker, once per holder until a fetch
    from it fails): asked of the holder's actor. The blocks then move over the KV transport."""
    import ray

    actor = ray.get_actor(holder.worker_id, namespace=NAMESPACE)
    address = ray.get(actor.block_address.remote(), timeout=FETCH_TIMEOUT_S)
    if address is None:
        raise LookupError(f"worker {holder.worker_id} serves no blocks")
    return address


@dataclass(slots=True)
class Worker:
    """The Conductor's view of one actor."""

    spec: WorkerSpec
    handle: object
    alive: bool = True
    pid: int = 0
    restarts: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    queued_ms: float = 0.0  # prefill: predicted work dispatched and not finished
    running: int = 0  # decode: requests streaming
    context_tokens: int = 0  # decode: their prompt tokens


class ClusterManager:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.workers: dict[str, Worker] = {}
        self._owns_ray = False

    def start(self, redis_url: str | None) -> None:
        """Start Ray (unless joining one) and every worker; returns when all answered a ping."""
        import ray

        self.init_ray()
        engine = self.config.engine
        for spec in self.config.specs():
            spec = WorkerSpec(spec.worker_id, spec.role, _with_redis(engine, redis_url), spec.transport, spec.cpus)
            self.workers[spec.worker_id] = Worker(spec, self._actor(spec))
        pings = {wid: w.handle.pid.remote() for wid, w in self.workers.items()}
        for wid, ref in pings.items():
            self.workers[wid].pid = ray.get(ref, timeout=300)

    def init_ray(self) -> None:
        """Start the embedded Ray (or join `ray_address`); a no-op once Ray is up. Call it on the
        main thread where possible: Ray installs its SIGTERM handler only there (and says so
        otherwise)."""
        import ray

        if ray.is_initialized():
            return
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        if self.config.ray_address is not None:
            ray.init(address=self.config.ray_address, namespace=NAMESPACE, log_to_driver=True)
            return
        total = self.config.prefill + self.config.decode
        # A loaded machine can start Ray's GCS slower than Ray's default 30 s wait.
        os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")
        kwargs = dict(num_cpus=max(os.cpu_count() or 1, total * self.config.worker_threads),
                      resources={"prefill": self.config.prefill, "decode": self.config.decode},
                      object_store_memory=self.config.object_store_mb * 2**20, include_dashboard=False,
                      namespace=NAMESPACE, log_to_driver=True, configure_logging=False)
        for attempt in range(1, RAY_START_ATTEMPTS + 1):
            try:
                ray.init(**kwargs)
                break
            except Exception as e:  # Ray raises bare Exceptions for a GCS/raylet that did not come up
                if attempt == RAY_START_ATTEMPTS:
                    raise
                log.warning("starting the embedded Ray failed (attempt %d of %d: %s); retrying",
                            attempt, RAY_START_ATTEMPTS, e)
                ray.shutdown()
                time.sleep(2.0)
        self._owns_ray = True

    def _actor(self, spec: WorkerSpec) -> object:
        import ray

        from decode_worker.worker import DecodeWorker
        from engine.worker import TransportBlockReader
        from prefill_worker.worker import PrefillWorker

        cls = PrefillWorker if spec.role == "prefill" else DecodeWorker
        options = {"name": spec.worker_id, "namespace": NAMESPACE, "resources": {spec.role: 1},
                   "num_cpus": self.config.worker_threads, "max_restarts": -1, "max_task_retries": 0,
                   "max_concurrency": 1000}
        if self.config.gpus(spec.role):
            options["num_gpus"] = self.config.gpus(spec.role)
        return ray.remote(cls).options(**options).remote(spec, TransportBlockReader(block_server_of, FETCH_TIMEOUT_S))

    def role(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.spec.role == role]

    async def check_health(self) -> None:
        """Ping every worker; a restarted actor (new pid) is counted and comes back alive."""
        async def one(w: Worker) -> None:
            try:
                load = await asyncio.wait_for(_await(w.handle.load.remote()), PING_TIMEOUT_S)
                pid = await asyncio.wait_for(_await(w.handle.pid.remote()), PING_TIMEOUT_S)
            except Exception as e:  # died, restarting, or hung: routed around until it answers
                if w.alive:
                    log.warning("worker %s is down: %s", w.spec.worker_id, e)
                w.alive = False
                return
            if w.pid and pid != w.pid:
                w.restarts += 1
                log.warning("worker %s was restarted (pid %d -> %d)", w.spec.worker_id, w.pid, pid)
            w.pid, w.alive, w.free_blocks = pid, bool(load["alive"]), load["free_blocks"]
            w.total_blocks = load["total_blocks"]

        await asyncio.gather(*(one(w) for w in self.workers.values()))

    def stop(self) -> None:
        import ray

        for w in self.workers.values():
            try:
                ray.kill(w.handle)
            except Exception as e:  # already gone
                log.debug("kill %s: %s", w.spec.worker_id, e)
        self.workers.clear()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()


def _with_redis(engine: EngineConfig, redis_url: str | None) -> EngineConfig:
    import dataclasses

    return dataclasses.replace(engine, redis_url=redis_url)


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


async def _await(ref: object) -> object:
    return await ref  # type: ignore[misc]


class WorkerLostError(ServiceUnavailableError):
    """A worker died (or is restarting) under a request."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(f"worker {worker_id} died under this request; retry")
        self.worker_id = worker_id


class TransferFailedError(ServiceUnavailableError):
    """A request's KV did not reach its decode worker intact (connection lost, timeout,
    checksum mismatch) while both workers lived; both sides gave its blocks back."""


def _is_transfer_failure(cause: BaseException) -> bool:
    from decode_worker.worker import KVTransferFailedError
    from transport.errors import TransportError

    return isinstance(cause, (TransportError, KVTransferFailedError))


@dataclass(frozen=True, slots=True)
class Route:
    prefill: Worker
    decode: Worker
    predicted_ttft_ms: float
    predicted_tbt_ms: float
    prefix_tokens: int
    prefill_cost_ms: float  # what this request adds to the prefill worker's queue (prefill + fetch)


class ClusterBackend(GenerationBackend):
    """The Conductor's backend over the Ray workers (see the module docstring)."""

    def __init__(self, config: ClusterConfig, redis_url: str | None) -> None:
        self.config = config
        self.redis_url = redis_url
        self.manager = ClusterManager(config)
        self.tokenizer = tokenizer_for_model(config.engine.model)
        self.cost: CostModel | None = None
        self.index: ClusterIndex | None = None
        self._health: asyncio.Task | None = None
        self._requests = 0  # attempts in flight
        self._streaming = 0  # of which past their first token
        self._reruns: collections.Counter[str] = collections.Counter()  # see BackendStats.requests_rerun

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await asyncio.to_thread(self.manager.start, self.redis_url)
        first = self.manager.role("prefill")[0].handle
        info = await _await(first.model_info.remote())
        self.info = info
        self.model = ModelCard(self.config.model_id, info["max_model_len"], info["vocab_size"])
        self.cost = await self._cost_model(first)
        if self.redis_url is not None:
            self.index = ClusterIndex(self.redis_url, HolderId("conductor", "conductor"))
        await self.manager.check_health()
        self._health = asyncio.create_task(self._health_loop())

    async def _cost_model(self, first: object) -> CostModel:
        if self.config.cost_model is not None:
            return CostModel.load(self.config.cost_model)
        log.warning("no cost model given: profiling the first prefill worker (quick)")
        return fit_profile(await _await(first.profile.remote(True)))  # type: ignore[arg-type]

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            await self.manager.check_health()

    async def stop(self) -> None:
        if self._health is not None:
            self._health.cancel()
        if self.index is not None:
            self.index.close()
        await asyncio.to_thread(self.manager.stop)

    def ready(self) -> bool:
        workers = self.manager.workers.values()
        return any(w.alive for w in workers if w.spec.role == "prefill") and \
            any(w.alive for w in workers if w.spec.role == "decode")

    def stats(self) -> BackendStats:
        decode = self.manager.role("decode")
        free = sum(w.free_blocks for w in decode)
        total = sum(w.total_blocks for w in decode)
        return BackendStats(self._streaming, self._requests - self._streaming, free, total, 0,
                            dict(self._reruns))

    # ------------------------------------------------------------------ requests

    async def generate(self, inp: GenerationInput) -> AsyncIterator[TokenDelta | Completion]:
        """Route and run. A worker lost, or a KV transfer failed, before the first token: the
        request is re-run once, transparently (nothing reached the client yet; a lost worker is
        routed around); later it is UNAVAILABLE."""
        rid = inp.request_id or f"req-{uuid.uuid4().hex[:16]}"
        arrival = time.perf_counter()
        excluded: set[str] = set()
        for attempt in (1, 2):
            sent = False
            try:
                # A fresh id per attempt: the workers may still be cleaning up the last one.
                wid = rid if attempt == 1 else f"{rid}~{attempt}"
                async for item in self._attempt(inp, rid, wid, arrival, excluded):
                    sent = True
                    yield item
                return
            except (WorkerLostError, TransferFailedError) as e:
                if sent or attempt == 2:
                    raise ServiceUnavailableError(str(e)) from e
                log.warning("request %s: %s before its first token; re-running it", rid, e)
                if isinstance(e, WorkerLostError):
                    excluded.add(e.worker_id)
                self._reruns["worker_lost" if isinstance(e, WorkerLostError) else "kv_transfer"] += 1

    async def _attempt(self, inp: GenerationInput, rid: str, wid: str, arrival: float,
                       excluded: set[str]) -> AsyncIterator[TokenDelta | Completion]:
        """One try on one prefill/decode pair; `wid` names the request on the workers."""
        from decode_worker.worker import DecodeTask
        from prefill_worker.worker import PrefillTask

        # Hashing the prompt and the index round trip run off the event loop: a slow or hung
        # Redis (up to the index's socket timeout) must not stall every other stream.
        prefix = await asyncio.to_thread(self.prefix_tokens, inp.prompt_ids, inp.cache_salt)
        route = self._route(inp, excluded, prefix)  # on the loop: decision + accounting at once
        n = len(inp.prompt_ids)
        p, d = route.prefill, route.decode
        timeout = self.config.request_timeout_s
        self._requests += 1
        p.queued_ms += route.prefill_cost_ms  # until its prefill ends (see `dequeue`)
        queued = [True]

        def dequeue(_: object = None) -> None:
            if queued[0]:
                queued[0] = False
                p.queued_ms -= route.prefill_cost_ms

        d.running += 1
        d.context_tokens += n
        finished = False
        first_at: float | None = None
        try:
            address, blocks = await self._call(d, d.handle.reserve.remote(wid, n))
            prefill_ref = p.handle.prefill.remote(PrefillTask(wid, inp.prompt_ids, inp.params, inp.cache_salt,
                                                               address, blocks, timeout))
            prefill_done = asyncio.ensure_future(self._call(p, prefill_ref))
            prefill_done.add_done_callback(dequeue)
            # A prefill that fails (worker died, push failed) stops the decode side's wait at once.
            prefill_done.add_done_callback(lambda f, d=d, wid=wid: f.cancelled() or f.exception() is None
                                           or d.handle.cancel.remote(wid))
            stream = d.handle.generate.options(num_returns="streaming").remote(
                DecodeTask(wid, inp.prompt_ids, inp.params, inp.cache_salt, blocks, timeout))
            async for ref in stream:
                event = await self._decode_event(d, ref, prefill_done)
                if first_at is None:
                    first_at = time.perf_counter()
                    self._streaming += 1
                if event.token_ids or event.text:
                    yield TokenDelta(rid, event.token_ids, event.text)
                if event.finish_reason is not None:
                    pre = await prefill_done
                    finished = True
                    yield _completion(rid, event, pre, n, arrival, first_at)
                    return
            raise ServiceUnavailableError(f"request {rid}: the decode stream ended without a result")
        finally:
            self._requests -= 1
            self._streaming -= first_at is not None
            dequeue()
            d.running -= 1
            d.context_tokens -= n
            if not finished:
                d.handle.cancel.remote(wid)
                p.handle.abort.remote(wid)

    async def _decode_event(self, d: Worker, ref: object, prefill_done: asyncio.Future) -> object:
        """The next decode event; if the prefill failed first, its error is the one to report."""
        try:
            return await self._call(d, ref)
        except ServiceUnavailableError:
            # The decode side often notices a dead prefill worker (its KV connection closed)
            # before Ray reports the death: give the prefill's outcome a moment to arrive.
            await asyncio.wait({prefill_done}, timeout=PING_TIMEOUT_S)
            if prefill_done.done() and not prefill_done.cancelled() and prefill_done.exception() is not None:
                raise prefill_done.exception() from None
            raise

    async def _call(self, worker: Worker, ref: object) -> object:
        """Await a worker's answer; a dead or failed worker is UNAVAILABLE (nothing was lost:
        the request's reservation is freed by `cancel`)."""
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return await _await(ref)
        except RayActorError as e:
            worker.alive = False
            raise WorkerLostError(worker.spec.worker_id) from e
        except RayTaskError as e:
            cause = e.cause if isinstance(e.cause, Exception) else e
            if _is_transfer_failure(cause):
                raise TransferFailedError(f"worker {worker.spec.worker_id}: {cause}") from e
            raise ServiceUnavailableError(f"worker {worker.spec.worker_id}: {cause}") from e

    # ------------------------------------------------------------------ routing

    def _route(self, inp: GenerationInput, excluded: set[str],
               prefix: tuple[dict[str, int], int, str]) -> Route:
        """Mooncake Algorithm 1 over the live workers, given the index's `prefix_tokens`, then
        the SLO check on its predictions."""
        assert self.cost is not None
        n = len(inp.prompt_ids)
        matched, best_len, best_holder = prefix
        request = RouteRequest(n, inp.params.max_tokens, best_len, best_holder if best_len else None)
        up = {wid for wid, w in self.manager.workers.items() if w.alive and wid not in excluded}
        prefill = [PrefillView(w.spec.worker_id, matched.get(w.spec.worker_id, 0), max(0.0, w.queued_ms),
                               w.spec.worker_id in up) for w in self.manager.role("prefill")]
        decode = [DecodeView(w.spec.worker_id, w.running, w.context_tokens, w.free_blocks, w.spec.worker_id in up)
                  for w in self.manager.role("decode")]
        plan = Router(self.cost, self.info["block_size"]).route(request, prefill, decode)
        self._check_slo(inp, plan.predicted_ttft_ms, plan.predicted_tbt_ms)
        workers = self.manager.workers
        chosen = next(e for e in plan.per_worker if e.worker_id == plan.prefill_id)
        return Route(workers[plan.prefill_id], workers[plan.decode_id], plan.predicted_ttft_ms,
                     plan.predicted_tbt_ms, plan.prefix_len, chosen.prefill_ms + chosen.transfer_ms)

    @staticmethod
    def _check_slo(inp: GenerationInput, ttft_ms: float, tbt_ms: float) -> None:
        slo = inp.slo
        miss = (slo.ttft_ms is not None and ttft_ms > slo.ttft_ms) or \
            (slo.tbt_ms is not None and tbt_ms > slo.tbt_ms)
        if miss:
            prediction = SloPrediction(ttft_ms, tbt_ms, slo.ttft_ms or 0.0, slo.tbt_ms or 0.0)
            raise SloMissError(prediction, ttft_ms / 1e3)

    def prefix_tokens(self, prompt_ids: list[int], cache_salt: str | None) -> tuple[dict[str, int], int, str]:
        """(per prefill worker: prompt tokens it can reuse from its own device or the node's
        host/disk, the longest match anywhere, its holder)."""
        if self.index is None:
            return {}, 0, ""
        bs = self.info["block_size"]
        root = root_hash(self.info["fingerprint"], self.info["dtype"], bs, cache_salt)
        result = self.index.lookup(block_hashes(prompt_ids, bs, root))
        matched: dict[str, int] = {}
        prefill_ids = [w.spec.worker_id for w in self.manager.role("prefill")]
        for m in result.matches:
            # Host/disk tiers are shared by the node's workers: a match there counts for all.
            shared = m.blocks_per_tier[1] + m.blocks_per_tier[2] > 0
            for owner in prefill_ids if shared else [m.holder.worker_id]:
                matched[owner] = max(matched.get(owner, 0), m.length * bs)
        best = result.best
        return matched, (best.length * bs if best else 0), (best.holder.worker_id if best else "")


def _completion(rid: str, event, pre, n_prompt: int, arrival: float, first_at: float) -> Completion:
    now = time.perf_counter()
    ttft = (first_at - arrival) * 1e3
    return Completion(rid, event.finish_reason, event.stop, Usage(n_prompt, pre.num_cached_tokens, event.num_output_tokens),
                      Timings(pre.queue_ms, pre.prefill_ms, pre.push_ms, ttft, event.tpot_ms, (now - arrival) * 1e3))
