"""The workers as Ray actors: Ray's lifecycle (embedded or joined cluster, placement by custom
resources, restarts) and the actor handles adapted to the worker protocols of `core.messages`.

`RayWorkers` starts the embedded Ray with a bounded object store (unless `ray_address`: then it
joins that cluster), starts each worker with one unit of its role's custom resource
(`--prefill-resource` / `--decode-resource`, default `prefill` / `decode`: an actor lands only on
a node that advertises it, e.g. `ray start --resources='{"prefill": 1}'`; `num_gpus` when CUDA
is present), pins each local worker to its own cores, and lets Ray restart dead actors
(`max_restarts`). With `--standby N` it starts N more actors per role, warms them up and places
them as standbys (conductor/workers.py): a dead serving actor's restart becomes the next standby. A worker learns its Ray node where Ray placed it (`on_this_ray_node`): its
cluster-index entries name that node, and a node-shared host arena is that node's.

The request path only sees `RayPrefill` / `RayDecode`: each verb awaits the actor's method; a
dead actor is `WorkerLostError`, a failed call raises the worker's own error.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from halfmoon.conductor.cluster_config import ClusterConfig
from halfmoon.conductor.flex_worker import FlexWorker
from halfmoon.conductor.workers import Worker, WorkerGroup
from halfmoon.core.adapters import AdapterRef
from halfmoon.core.errors import ConfigError, HalfmoonError
from halfmoon.core.messages import (DecodeTask, EngineInfo, IntegrityReport, KVHandoff, PrefillResult,
                           PrefillTask, Profile, TokenChunk, WorkerError, WorkerLoad, WorkerLostError)
from halfmoon.decode_worker.worker import DecodeWorker
from halfmoon.engine.config import WorkerSpec
from halfmoon.prefill_worker.worker import PrefillWorker

log = logging.getLogger(__name__)

NAMESPACE = "halfmoon"
NODE_ID_CHARS = 12  # of Ray's 56 hex digits: the node's name in the index and the worker's load
RESOURCE_POLL_S = 1.0
DEATH_INFO_WAIT_MS = 100  # with standbys (see init_ray)
RAY_START_ATTEMPTS = 3  # CI saw Ray's GCS and raylet miss their own 30 s start-up waits
RANK_LOST_EXIT = 70  # a tensor-parallel worker's exit status when one of its ranks died


def actor_options(config: ClusterConfig, spec: WorkerSpec) -> dict[str, Any]:
    """Ray's options for a worker actor. `enable_task_events=False`: every request is a few actor
    calls (generate, load polls) and Ray's GCS keeps ~3.4 KB of events per call up to 100 000
    calls (`RAY_task_events_max_num_task_in_gcs`) — a gcs_server that grew 72 -> 98 MiB over a
    30-minute soak. A serving cluster's requests are traced by OpenTelemetry, not Ray's task
    table."""
    options: dict[str, Any] = {"name": spec.worker_id, "namespace": NAMESPACE,
                               "resources": {config.resource(spec.role): 1},
                               "num_cpus": config.worker_threads, "max_restarts": -1,
                               "max_task_retries": 0, "max_concurrency": 1000,
                               "enable_task_events": False}
    if config.gpus(spec.role):
        options["num_gpus"] = config.gpus(spec.role)
    return options


class RayWorker:
    """A worker's Ray actor handle as a `core.messages.WorkerApi`."""

    def __init__(self, worker_id: str, handle: Any) -> None:
        self.worker_id = worker_id
        self.handle = handle

    async def _call(self, method: str, *args: object) -> Any:
        return await self._result(getattr(self.handle, method).remote(*args))

    async def _result(self, ref: Any) -> Any:
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return await ref
        except RayActorError as e:
            raise WorkerLostError(self.worker_id) from e
        except RayTaskError as e:
            cause = e.cause
            if isinstance(cause, HalfmoonError):
                raise cause from e
            raise WorkerError(f"worker {self.worker_id}: {cause if cause is not None else e}") from e

    async def load(self) -> WorkerLoad:
        return await self._call("load")

    async def pid(self) -> int:
        return await self._call("pid")

    async def engine_info(self) -> EngineInfo:
        return await self._call("engine_info")

    async def profile(self, quick: bool = True) -> Profile:
        return await self._call("profile", quick)

    async def block_address(self) -> str | None:
        return await self._call("block_address")

    async def check_integrity(self) -> IntegrityReport:
        return await self._call("check_integrity")

    async def warm_up(self) -> float:
        return await self._call("warm_up")

    async def load_adapter(self, adapter: AdapterRef) -> None:
        await self._call("load_adapter", adapter)


class RayPrefill(RayWorker):
    """`core.messages.PrefillApi` over a prefill worker's actor."""

    async def prefill(self, task: PrefillTask) -> PrefillResult:
        return await self._call("prefill", task)

    async def abort(self, request_id: str) -> None:
        await self._call("abort", request_id)

    async def corrupt_next_push(self, request_id: str | None = None, times: int = 1) -> None:
        await self._call("corrupt_next_push", request_id, times)

    async def drop_kv_connections(self) -> int:
        return await self._call("drop_kv_connections")


class RayDecode(RayWorker):
    """`core.messages.DecodeApi` over a decode worker's actor (tokens as a Ray streaming call)."""

    async def reserve(self, request_id: str, num_prompt_tokens: int, max_new_tokens: int,
                      timeout_s: float) -> KVHandoff:
        return await self._call("reserve", request_id, num_prompt_tokens, max_new_tokens, timeout_s)

    async def generate(self, task: DecodeTask) -> AsyncIterator[TokenChunk]:
        async for ref in self.handle.generate.options(num_returns="streaming").remote(task):
            yield await self._result(ref)

    async def cancel(self, request_id: str) -> None:
        await self._call("cancel", request_id)


class RayFlex(RayPrefill, RayDecode):
    """Both protocols over a worker that serves either role (conductor/flex_worker.py)."""

    async def become(self, role: str, max_prefill_seqs: int | None) -> None:
        await self._call("become", role, max_prefill_seqs)


def worker_api(config: ClusterConfig, spec: WorkerSpec, handle: Any) -> RayWorker:
    """The handle as its role's protocol (both, when the planner may flip it)."""
    if config.planner.mode == "act":
        return RayFlex(spec.worker_id, handle)
    return RayPrefill(spec.worker_id, handle) if spec.role == "prefill" else RayDecode(spec.worker_id, handle)


class RayWorkers(WorkerGroup):
    """The workers of `config` as Ray actors."""

    def __init__(self, config: ClusterConfig) -> None:
        super().__init__()
        self.config = config
        self._owns_ray = False

    def start(self, redis_url: str | None) -> None:
        """Start Ray (unless joining one) and every worker, standbys included; returns when all
        answered a ping and each standby ran its warm-up request."""
        import ray

        self.init_ray()
        self.await_resources(self.config.ray_wait_s)
        for spec in self.config.specs(redis_url):
            handle = self._actor(spec)
            self.place(Worker(spec, worker_api(self.config, spec, handle)), self.config.is_standby(spec))
        pings = {w.worker_id: (w, w.api.handle.pid.remote()) for w in self.everyone()}  # type: ignore[union-attr]
        for w, ref in pings.values():
            w.pid = ray.get(ref, timeout=300)
        warm = {w.worker_id: w.api.handle.warm_up.remote() for w in self.standbys.values()}  # type: ignore[union-attr]
        for wid, ref in warm.items():
            log.info("standby %s warmed up in %.2f s", wid, ray.get(ref, timeout=300))

    def init_ray(self) -> None:
        """Start the embedded Ray (or join `ray_address`); a no-op once Ray is up. Call it on the
        main thread where possible: Ray installs its SIGTERM handler only there (and says so
        otherwise)."""
        import ray

        if ray.is_initialized():
            return
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        if self.config.standby:
            # A call to an actor whose process died waits this long for the GCS's word on its
            # death before it fails (Ray's default 1000 ms, most of a promotion's ~1.5 s when
            # idle): with a standby to promote, a quick verdict is what the client waits for.
            os.environ.setdefault("RAY_timeout_ms_task_wait_for_death_info", str(DEATH_INFO_WAIT_MS))
        if self.config.ray_address is not None:
            ray.init(address=self.config.ray_address, namespace=NAMESPACE, log_to_driver=True)
            return
        self._start_embedded_ray()
        self._owns_ray = True

    def await_resources(self, timeout_s: float) -> None:
        """Wait until the cluster advertises each role's resource once per worker of the role
        (worker nodes may join after the head: pods start in any order); past `timeout_s`,
        `ConfigError` naming what is missing (the actors would wait for nodes forever)."""
        import ray

        deadline = time.monotonic() + timeout_s
        said = False
        while missing := self._missing_resources(ray.cluster_resources()):
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"the Ray cluster at {self.config.ray_address or 'the embedded Ray'} still lacks "
                    f"{'; '.join(missing)} after {timeout_s:g} s: start nodes with "
                    "`ray start --resources='{\"<name>\": 1}'` or change --prefill / --decode / "
                    "--prefill-resource / --decode-resource")
            if not said:
                log.warning("waiting for Ray nodes: %s", "; ".join(missing))
                said = True
            time.sleep(RESOURCE_POLL_S)

    def _missing_resources(self, have: dict[str, float]) -> list[str]:
        need = ((self.config.resource("prefill"), self.config.count("prefill"), "prefill"),
                (self.config.resource("decode"), self.config.count("decode"), "decode"))
        return [f"{count} {role} worker(s) need 1 {name!r} each, the cluster has {have.get(name, 0):g}"
                for name, count, role in need if have.get(name, 0) < count]

    def _start_embedded_ray(self) -> None:
        import ray

        total = self.config.count("prefill") + self.config.count("decode")
        # A loaded machine can start Ray's GCS slower than Ray's default 30 s wait.
        os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")
        kwargs = dict(num_cpus=max(os.cpu_count() or 1, total * self.config.worker_threads),
                      resources={self.config.prefill_resource: self.config.count("prefill"),
                                 self.config.decode_resource: self.config.count("decode")},
                      object_store_memory=self.config.object_store_mb * 2**20, include_dashboard=False,
                      namespace=NAMESPACE, log_to_driver=True, configure_logging=False)
        for attempt in range(1, RAY_START_ATTEMPTS + 1):
            try:
                ray.init(**kwargs)
                return
            except Exception as e:  # Ray raises bare Exceptions for a GCS/raylet that did not come up
                if attempt == RAY_START_ATTEMPTS:
                    raise
                log.warning("starting the embedded Ray failed (attempt %d of %d: %s); retrying",
                            attempt, RAY_START_ATTEMPTS, e)
                ray.shutdown()
                time.sleep(2.0)

    def _actor(self, spec: WorkerSpec) -> Any:
        import ray

        if self.config.planner.mode == "act":
            cls: type = RayFlexWorker
        else:
            cls = RayPrefillWorker if spec.role == "prefill" else RayDecodeWorker
        return ray.remote(cls).options(**actor_options(self.config, spec)).remote(spec)

    def _launch(self, spec: WorkerSpec) -> Worker:
        """One more actor (the planner's add): started, answered and warmed up."""
        import ray

        handle = self._actor(spec)
        worker = Worker(spec, worker_api(self.config, spec, handle))
        worker.pid = ray.get(handle.pid.remote(), timeout=300)
        log.info("worker %s started and warmed up in %.2f s", spec.worker_id,
                 ray.get(handle.warm_up.remote(), timeout=300))
        return worker

    def _shut(self, worker: Worker) -> None:
        """Close the worker's engine (its tiers and index entries), then kill its actor."""
        import ray

        handle = worker.api.handle  # type: ignore[union-attr]
        try:
            ray.get(handle.close.remote(), timeout=10)
        except Exception as e:  # a dead or hung worker holds nothing worth waiting for
            log.warning("worker %s: did not close cleanly before removal: %s", worker.worker_id, e)
        ray.kill(handle)

    def stop(self) -> None:
        import ray

        if self.config.tracing.tracing:
            self._flush_traces()
        self._close_workers()
        for w in self.everyone():
            try:
                ray.kill(w.api.handle)  # type: ignore[union-attr]
            except Exception as e:  # already gone
                log.debug("kill %s: %s", w.worker_id, e)
        self.workers.clear()
        self.standbys.clear()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    def _close_workers(self, timeout_s: float = 10.0) -> None:
        """Each worker closes its engine before it is killed: the last worker of a node removes
        the node's host arena from /dev/shm (memory a killed worker would leave held). One that
        does not answer in time is killed anyway: said in the log."""
        import ray

        refs = {w.api.handle.close.remote(): w.worker_id for w in self.everyone()}  # type: ignore[union-attr]
        done, late = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as e:  # a dead worker holds nothing; its tiers' files stay for the next
                log.warning("worker %s: did not close cleanly: %s", refs[ref], e)
        for ref in late:
            log.warning("worker %s: did not close within %.0f s; killed", refs[ref], timeout_s)

    def _flush_traces(self, timeout_s: float = 5.0) -> None:
        """The workers' buffered spans exported before they are killed (a worker that does not
        answer in time loses its last spans: said in the log)."""
        import ray

        refs = {w.api.handle.flush_traces.remote(): w.worker_id for w in self.everyone()}  # type: ignore[union-attr]
        done, late = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref in done:
            try:
                if not ray.get(ref):
                    log.warning("worker %s: its spans were not all exported before it stopped", refs[ref])
            except Exception as e:  # a dead worker's spans are gone with it
                log.warning("worker %s: could not flush its spans: %s", refs[ref], e)
        for ref in late:
            log.warning("worker %s: did not flush its spans within %.0f s", refs[ref], timeout_s)


def on_this_ray_node(spec: WorkerSpec) -> WorkerSpec:
    """`spec` of a worker whose actor Ray has just placed (called in the actor, on every
    (re)start): its node is the Ray node's id, and a node-shared host arena gets that node's
    name (workers of one node share it; two Ray nodes on one machine do not). A disk tier is
    one process's (kvpool/disk_tier.py): each worker's slab lives in `<disk dir>/<worker id>`,
    where its restart finds it again."""
    import ray

    node = ray.get_runtime_context().get_node_id()[:NODE_ID_CHARS]
    engine = spec.engine
    if engine.host_cache_name is not None:
        engine = replace(engine, host_cache_name=f"{engine.host_cache_name}-{node}")
    if engine.disk_cache_dir is not None:
        engine = replace(engine, disk_cache_dir=worker_disk_dir(engine.disk_cache_dir, spec.worker_id))
    return replace(spec, node_id=node, engine=engine)


def worker_disk_dir(disk_cache_dir: str, worker_id: str) -> str:
    """The worker's own directory under the cluster's `--disk-cache-dir`."""
    return os.path.join(disk_cache_dir, worker_id)


def exit_as_one(worker_id: str, error: Exception) -> None:
    """A tensor-parallel worker lost a rank: its actor's process exits at once (the rest of its
    ranks see their pipe close and exit too), so Ray restarts the whole worker and every call in
    flight is `WorkerLostError`: the Conductor moves those requests (conductor/migration.py)."""
    log.critical("worker %s exits as one, to be restarted: %s", worker_id, error)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(RANK_LOST_EXIT)


def ray_progress_bar(**kwargs: Any) -> Any:
    """A progress bar with tqdm's signature that a Ray actor updates and the driver draws
    (ray.experimental.tqdm_ray): the start-up profile shows on `serve`'s console."""
    from ray.experimental import tqdm_ray

    return tqdm_ray.tqdm(**kwargs)


class RayPrefillWorker(PrefillWorker):
    """A prefill worker as a Ray actor: its spec completed where Ray placed it."""

    progress_bar = staticmethod(ray_progress_bar)  # the start-up profile's bar, drawn by the driver

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(on_this_ray_node(spec))

    def rank_lost(self, error: Exception) -> None:
        exit_as_one(self.spec.worker_id, error)


class RayFlexWorker(FlexWorker):
    """A worker of either role as a Ray actor (`--planner act`): its spec completed where Ray
    placed it."""

    progress_bar = staticmethod(ray_progress_bar)

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(on_this_ray_node(spec))

    def rank_lost(self, error: Exception) -> None:
        exit_as_one(self.spec.worker_id, error)


class RayDecodeWorker(DecodeWorker):
    """A decode worker as a Ray actor: its spec completed where Ray placed it."""

    progress_bar = staticmethod(ray_progress_bar)  # the start-up profile's bar, drawn by the driver

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(on_this_ray_node(spec))

    def rank_lost(self, error: Exception) -> None:
        exit_as_one(self.spec.worker_id, error)
