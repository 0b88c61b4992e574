"""The workers as Ray actors: Ray's lifecycle (embedded or joined cluster, placement by custom
resources, restarts) and the actor handles adapted to the worker protocols of `core.messages`.

`RayWorkers` starts the embedded Ray with a bounded object store (unless `ray_address`), starts
each worker with the custom resource of its role (`prefill` / `decode`, so actors land on the
right nodes; `num_gpus` when CUDA is present), pins each local worker to its own cores, and lets
Ray restart dead actors (`max_restarts`). The request path only sees `RayPrefill` / `RayDecode`:
each verb awaits the actor's method; a dead actor is `WorkerLostError`, a failed call raises
the worker's own error.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from conductor.cluster_config import ClusterConfig
from conductor.workers import Worker, WorkerGroup
from core.errors import HalfmoonError
from core.messages import (DecodeTask, EngineInfo, IntegrityReport, KVHandoff, PrefillResult,
                           PrefillTask, Profile, TokenChunk, WorkerError, WorkerLoad, WorkerLostError)
from engine.config import WorkerSpec

log = logging.getLogger(__name__)

NAMESPACE = "halfmoon"
RAY_START_ATTEMPTS = 3  # CI saw Ray's GCS and raylet miss their own 30 s start-up waits


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


class RayWorkers(WorkerGroup):
    """The workers of `config` as Ray actors."""

    def __init__(self, config: ClusterConfig) -> None:
        super().__init__()
        self.config = config
        self._owns_ray = False

    def start(self, redis_url: str | None) -> None:
        """Start Ray (unless joining one) and every worker; returns when all answered a ping."""
        import ray

        self.init_ray()
        for spec in self.config.specs(redis_url):
            handle = self._actor(spec)
            api = RayPrefill(spec.worker_id, handle) if spec.role == "prefill" else RayDecode(spec.worker_id, handle)
            self.workers[spec.worker_id] = Worker(spec, api)
        pings = {wid: w.api.handle.pid.remote() for wid, w in self.workers.items()}  # type: ignore[union-attr]
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
        self._start_embedded_ray()
        self._owns_ray = True

    def _start_embedded_ray(self) -> None:
        import ray

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

        from decode_worker.worker import DecodeWorker
        from prefill_worker.worker import PrefillWorker

        cls = PrefillWorker if spec.role == "prefill" else DecodeWorker
        options: dict[str, Any] = {"name": spec.worker_id, "namespace": NAMESPACE, "resources": {spec.role: 1},
                                   "num_cpus": self.config.worker_threads, "max_restarts": -1,
                                   "max_task_retries": 0, "max_concurrency": 1000}
        if self.config.gpus(spec.role):
            options["num_gpus"] = self.config.gpus(spec.role)
        return ray.remote(cls).options(**options).remote(spec)

    def stop(self) -> None:
        import ray

        if self.config.tracing.tracing:
            self._flush_traces()
        for w in self.workers.values():
            try:
                ray.kill(w.api.handle)  # type: ignore[union-attr]
            except Exception as e:  # already gone
                log.debug("kill %s: %s", w.worker_id, e)
        self.workers.clear()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    def _flush_traces(self, timeout_s: float = 5.0) -> None:
        """The workers' buffered spans exported before they are killed (a worker that does not
        answer in time loses its last spans: said in the log)."""
        import ray

        refs = {w.api.handle.flush_traces.remote(): w.worker_id for w in self.workers.values()}  # type: ignore[union-attr]
        done, late = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref in done:
            try:
                if not ray.get(ref):
                    log.warning("worker %s: its spans were not all exported before it stopped", refs[ref])
            except Exception as e:  # a dead worker's spans are gone with it
                log.warning("worker %s: could not flush its spans: %s", refs[ref], e)
        for ref in late:
            log.warning("worker %s: did not flush its spans within %.0f s", refs[ref], timeout_s)
