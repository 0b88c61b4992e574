"""The shape of the disaggregated cluster: how many workers of each role, and what each runs."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field

from halfmoon.conductor.gpu_plan import GpuShare, plan_gpus, visible_gpus
from halfmoon.conductor.planner import PlannerConfig
from halfmoon.core.errors import ConfigError, check_positive
from halfmoon.core.logs import LogConfig
from halfmoon.core.tracing import TracingConfig
from halfmoon.engine.config import EngineConfig, WorkerSpec
from halfmoon.transport.config import TransportConfig

# A Ray custom resource's name as `ray start --resources` JSON and Helm values carry it.
RESOURCE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]{0,62}")


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The cluster `halfmoon serve --prefill N --decode M` runs.

    prefill: prefill workers.
    decode: decode workers.
    engine / transport: what every worker runs (its engine, its KV transport).
    worker_threads: CPU threads (and pinned cores, locally) per worker.
    ray_address: join this Ray cluster (None = start an embedded one).
    object_store_mb: the embedded Ray's object store (Ray takes 30% of RAM otherwise).
    cost_model: a `halfmoon profile` JSON (co-located too); None = the cached profile of this
        machine and worker shape, else a quick profile at start (then cached).
    request_timeout_s: bound on a request's KV transfer and prefill.
    model_id: the model's name in the API.
    prefill_gpus: GPUs per prefill worker actor (default, with `--device cuda`: 1 each where this
        machine has a GPU per worker, else an equal share of one (conductor/gpu_plan.py); 1 when
        joining a Ray cluster; 0 with `--device cpu`).
    decode_gpus: GPUs per decode worker actor (default: as above).
    tracing: OpenTelemetry tracing of the Conductor and every worker (resolved: `TracingConfig.resolve`).
    log: how the Conductor and every worker log.
    migration_attempts: times one request may move to other (or restarted) workers after a
        worker died or its KV transfer failed; past it the client gets UNAVAILABLE.
    migration_stall_s: the longest one request waits, in all, for a live worker to move to.
    prefill_resource: the Ray custom resource a prefill worker's actor asks one unit of: it lands
        only on Ray nodes that advertise it (`ray start --resources='{"prefill": 1}'`).
    decode_resource: the same for a decode worker (the embedded Ray advertises both).
    ray_wait_s: how long a joined Ray cluster may take to advertise one unit of each role's
        resource per worker (worker pods start in any order) before `serve` exits naming what
        is missing.
    prefill_tp: tensor-parallel size of every prefill worker: one worker (one Ray actor, one
        unit for routing and admission) spans this many ranks, its follower ranks processes of
        the actor on its node (engine/tp_ranks.py); 1 = one process.
    decode_tp: the same for every decode worker; it need not equal prefill_tp: the KV moves
        between the layouts, each decode rank receiving only its heads (transport/heads.py).
    prefill_max_seqs: prompts a prefill worker's engine steps at once (its engine's
        max_prefill_seqs; the token budget still chunks a long prompt); None = as many as the
        budget takes. A step's
        prompts all get their first tokens at its end: on a burst, one prompt a step serves the
        window's shortest prompts first (conductor/prefill_steps.py; serve's default is 1,
        conductor/serve_defaults.py).
    standby: spare workers per role, started, loaded and warmed at boot but not routed to
        (not counted in capacity, admission or the router); when a worker dies the Conductor
        promotes one in its place at once (conductor/workers.py). Each needs one more unit of
        its role's Ray resource and costs one worker's memory.
    planner: the planner that re-balances the pools at run time (conductor/planner.py; mode
        `act` starts every worker able to serve either role: conductor/rebalance.py). Off here
        (a ClusterBackend built without an advisor has none); `halfmoon serve`'s default is
        `advise` (its flags, cli/planner_flags.py, start from PlannerConfig's defaults).
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
    prefill_gpus: int | None = None
    decode_gpus: int | None = None
    tracing: TracingConfig = field(default_factory=TracingConfig)
    log: LogConfig = field(default_factory=LogConfig)
    migration_attempts: int = 3
    migration_stall_s: float = 30.0
    prefill_resource: str = "prefill"
    decode_resource: str = "decode"
    ray_wait_s: float = 300.0
    prefill_tp: int = 1
    decode_tp: int = 1
    standby: int = 0
    prefill_max_seqs: int | None = None
    planner: PlannerConfig = field(default_factory=lambda: PlannerConfig(mode="off"))

    def __post_init__(self) -> None:
        check_positive(self, "prefill", "decode", "worker_threads", "object_store_mb", "request_timeout_s",
                       "migration_stall_s", "ray_wait_s", "prefill_tp", "decode_tp")
        if self.prefill_max_seqs is not None and self.prefill_max_seqs < 1:
            raise ConfigError(f"prefill_max_seqs must be >= 1, got {self.prefill_max_seqs}")
        if self.standby < 0:
            raise ConfigError(f"standby must be >= 0, got {self.standby}")
        if self.migration_attempts < 0:
            raise ConfigError(f"migration_attempts must be >= 0, got {self.migration_attempts}")
        for name in ("prefill_resource", "decode_resource"):
            if not RESOURCE_NAME.fullmatch(getattr(self, name)):
                raise ConfigError(f"{name} must be a Ray resource name (letters, digits, _ . - /), "
                                  f"got {getattr(self, name)!r}")
        if self.prefill_resource == self.decode_resource:
            raise ConfigError(f"prefill_resource and decode_resource are both {self.prefill_resource!r}: "
                              "each role needs its own, or one role's actors would take the other's nodes")

    def resource(self, role: str) -> str:
        """The Ray resource `role`'s actors ask one unit of."""
        return self.prefill_resource if role == "prefill" else self.decode_resource

    def tp(self, role: str) -> int:
        """Tensor-parallel size of `role`'s workers."""
        return self.prefill_tp if role == "prefill" else self.decode_tp

    def prefill_seqs(self, role: str) -> int | None:
        """The max_prefill_seqs of `role`'s engines (prefill workers: `prefill_max_seqs`)."""
        return self.prefill_max_seqs if role == "prefill" else self.engine.max_prefill_seqs

    def gpus(self, role: str) -> float:
        """The Ray `num_gpus` of `role`'s actors: given, else the planned share per rank."""
        given = self.prefill_gpus if role == "prefill" else self.decode_gpus
        return float(given) if given is not None else self.gpu_share().gpus * self.tp(role)

    def gpu_share(self) -> GpuShare:
        """Each worker's GPU share and allocator cap (conductor/gpu_plan.py)."""
        visible = visible_gpus() if self.ray_address is None and self.engine.device == "cuda" else None
        return plan_gpus(self.engine.device, visible, self.count("prefill") + self.count("decode"),
                         self.engine.gpu_memory_fraction)

    def count(self, role: str, standby: bool = True) -> int:
        """Worker actors of `role`: the serving ones, plus the standbys unless `standby` is False."""
        serving = self.prefill if role == "prefill" else self.decode
        return serving + self.standby * standby

    def is_standby(self, spec: WorkerSpec) -> bool:
        """Whether `spec` (of `specs()`) starts as a standby: a role's last `standby` workers."""
        return int(spec.worker_id.rsplit("-", 1)[1]) >= self.count(spec.role, standby=False)

    def specs(self, redis_url: str | None) -> list[WorkerSpec]:
        """Every worker's spec, standbys included (a role's last `standby`: `is_standby`), its
        engine on the index at `redis_url` (None: no index); local workers get consecutive cores
        of their own."""
        n_prefill = self.count("prefill")
        roles = ["prefill"] * n_prefill + ["decode"] * self.count("decode")
        return [self.spec(role, i if role == "prefill" else i - n_prefill, i, redis_url)
                for i, role in enumerate(roles)]

    def spec(self, role: str, index: int, slot: int, redis_url: str | None) -> WorkerSpec:
        """The spec of worker `<role>-<index>`, the `slot`-th worker started (its cores, locally)."""
        engine = dataclasses.replace(self.engine, redis_url=redis_url, tp=self.tp(role),
                                     gpu_memory_fraction=self.gpu_share().memory_fraction,
                                     max_prefill_seqs=self.prefill_seqs(role))
        cores = os.cpu_count() or 1
        first = (slot * self.worker_threads) % cores
        cpus = tuple((first + k) % cores for k in range(self.worker_threads)) if self.ray_address is None else None
        if cpus is None and engine.num_threads is None:  # on another node: its threads, unpinned
            engine = dataclasses.replace(engine, num_threads=self.worker_threads)
        return WorkerSpec(f"{role}-{index}", role, engine, self.transport, cpus, tracing=self.tracing, log=self.log)
