"""The simulated cluster: the production decision path over simulated workers.

    arrival --> Dispatcher.dispatch (conductor/dispatch.py: Router + Admission + ledgers, the
                objects `halfmoon serve` runs) --> rejected: recorded with admission's reason
                                               --> admitted: prefill worker --> decode worker
    first token: PrefillLedger.finish, the booking's joins_at   (as conductor/cluster.py does)
    last token:  DecodeLedger.release, Dispatcher.finished      (calibration, output estimate)

The prefix match each prefill worker reports is read from its own `TieredCache` (the real
BlockPool above host/disk `HashLRU`s): what a fresh cluster index would say. Co-located mode has
one engine and `Dispatcher.dispatch_colocated` over its two ledgers, as conductor/colocated.py.
Before each decision the ledgers learn how many tokens each running request has made, as the
Conductor learns it from the token stream.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from halfmoon.conductor.admission import AdmissionConfig
from halfmoon.conductor.admission_window import AdmissionWindow
from halfmoon.conductor.backend import Slo
from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.dispatch import Ask, DecodeSide, Dispatcher, PrefillSide, PrefixMatch
from halfmoon.conductor.errors import OverloadedError, ServiceUnavailableError
from halfmoon.conductor.ledger import DecodeLedger, PrefillLedger
from halfmoon.conductor.prefill_steps import PrefillSteps
from halfmoon.conductor.serve_defaults import serve_admission, serve_shape, tier_tokens
from halfmoon.core.errors import ConfigError, check_positive
from halfmoon.sim.engines import (KV_TAIL, AdapterSlots, Clock, ColocatedWorker, Cores, DecodeBatch, DecodeWorker, Flight,
                                  PrefillWorker)
from halfmoon.sim.tiers import Capacity, TieredCache
from halfmoon.sim.trace import HASH_BLOCK_TOKENS
from halfmoon.sim.workload import SimRequest, Workload


TICK = 256  # arrivals per progress tick
# reading + checking + laying out a rank-16 SmolLM2 adapter, then its slot copy: `halfmoon bench
# lora` on CPU (docs/BENCHMARKS.md); a simulated worker pays it for an adapter it does not hold
ADAPTER_LOAD_MS = 80.0


_SERVE = serve_shape()  # the shape and engine `halfmoon serve` starts with no flags


@dataclass(frozen=True, slots=True)
class SimConfig:
    """A cluster shape and how it serves.

    prefill, decode: workers per role (ignored when `colocated`: one engine).
    device_tokens: KV tokens of each worker's device pool (decode: what its ledger books;
        prefill and co-located: its prefix cache too). host_tokens, disk_tokens: each prefill
        (or co-located) worker's host DRAM and disk tiers.
    block_size: the engine's KV block (the decode booking's unit); the prefix caches work in
        the trace's 512-token blocks (sim/workload.py).
    chunk: prefill tokens per step (the engine's max_num_batched_tokens): a prefill worker's
        steps (several prompts each), co-located the engine's steps.
    max_seqs: requests decoding at once per worker.
    prefill_max_seqs: prompts a prefill worker steps at once (serve's `--prefill-max-seqs`;
        None: no limit but the chunk).
    kv_tail: the share of a prompt's KV transfer not hidden behind its prefill.
    overhead_ms: what a request pays outside the engines (RPCs, the KV handoff's handshake,
        streaming back through the Conductor): the simulated first token comes this much
        later (1P1D: its decode join; co-located: its entry into the engine's queue). The cost
        model times engines alone; None (the default) = the cost model's `overhead_ms`, which
        `halfmoon serve` measures at start with lone probes through the real path (the model
        `GET /dashboard/api/cost-model` serves; 0 in a profile file and for the built-in GPU
        profiles, which cite engine figures); `halfmoon bench sim-vs-live` measures it too.
    drain_s: requests still running this long after the window are cut (None: run to the end).
    tokens_per_step: decode tokens per request per step (> 1 with speculative decoding: what a
        live decode worker measures, `halfmoon_worker_speculative_*` / `bench engine
        --speculative`). A step of b requests then computes b x tokens_per_step rows and emits
        tokens_per_step tokens each: the workers are simulated one token-time per step
        (`SpeculativeCost`) and admission counts the same tokens per step.
    prefill_tp, decode_tp: each worker's tensor-parallel size (devices it holds); the cost
        model is the layout's (`CostModel.with_decode_of`: prefill from a TP=prefill_tp profile,
        decode steps from a TP=decode_tp one). Co-located: prefill_tp is the engine's.
    cores: the compute the workers share, in workers that step at full speed at once (CPU workers
        on one machine: its cores / each worker's threads); while more step, each step is
        stretched by their share (sim/engines.py `Cores`), and a cost model's `prefill_scale`
        (a start-up burst's slowdown, this sharing included) times the workers without the
        share it measured (`unshared_scale`); admission prices with the whole scale. None (the
        default): each worker its own device, as GPUs are.
    max_loras, adapter_load_ms: each prefill (or co-located) worker's LoRA slots and what
        reading an adapter it does not hold costs (a trace's `adapter` key): paid before its
        prefill, priced by the router as the Conductor prices it. The default is `halfmoon bench
        lora`'s SmolLM2 rank-16 figure on CPU (docs/BENCHMARKS.md).
    """

    prefill: int = _SERVE.prefill
    decode: int = _SERVE.decode
    colocated: bool = False
    device_tokens: int = 65536
    host_tokens: int = 0
    disk_tokens: int = 0
    block_size: int = _SERVE.engine.block_size
    chunk: int = _SERVE.engine.max_num_batched_tokens
    max_seqs: int = _SERVE.engine.max_num_seqs
    prefill_max_seqs: int | None = _SERVE.prefill_max_seqs
    kv_tail: float = KV_TAIL
    overhead_ms: float | None = None
    drain_s: float | None = None
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    tokens_per_step: float = 1.0
    prefill_tp: int = 1
    decode_tp: int = 1
    max_loras: int = _SERVE.engine.max_loras
    adapter_load_ms: float = ADAPTER_LOAD_MS
    cores: float | None = None

    def __post_init__(self) -> None:
        if not self.colocated and (self.prefill < 1 or self.decode < 1):
            raise ConfigError(f"a cluster needs >= 1 prefill and >= 1 decode worker, got {self.prefill}P{self.decode}D")
        check_positive(self, "device_tokens", "block_size", "chunk", "max_seqs", "prefill_tp", "decode_tp", "max_loras")
        if self.tokens_per_step < 1.0:
            raise ConfigError(f"tokens_per_step must be >= 1, got {self.tokens_per_step}")
        if self.cores is not None and not self.cores > 0:
            raise ConfigError(f"cores must be > 0 (or None: a device each), got {self.cores}")
        for name in ("host_tokens", "disk_tokens", "overhead_ms", "adapter_load_ms"):
            if (getattr(self, name) or 0) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def shape(self) -> str:
        if self.colocated:
            return "co-located"
        layout = "" if (self.prefill_tp, self.decode_tp) == (1, 1) else f" tp{self.prefill_tp}:{self.decode_tp}"
        return f"{self.prefill}P{self.decode}D{layout}"

    @property
    def workers(self) -> int:
        return 1 if self.colocated else self.prefill + self.decode

    @property
    def devices(self) -> int:
        """Devices the shape holds: a tensor-parallel worker one per rank."""
        return self.prefill_tp if self.colocated else self.prefill * self.prefill_tp + self.decode * self.decode_tp

    def capacity(self) -> Capacity:
        """A prefix cache's tiers in 512-token blocks."""
        return Capacity(self.device_tokens // HASH_BLOCK_TOKENS, self.host_tokens // HASH_BLOCK_TOKENS,
                        self.disk_tokens // HASH_BLOCK_TOKENS)


def serve_config(kv_bytes_per_token: int, **changes: object) -> SimConfig:
    """The cluster `halfmoon serve` starts with no flags, for a model whose KV is
    `kv_bytes_per_token` (a cost model's): its shape, block, chunk, batch, admission and each
    worker's tiers in that model's tokens (`conductor.serve_defaults.tier_tokens`: 1 GiB of
    device KV, the node's 4 GiB host tier as each prefill worker's, no disk tier). `changes`
    override fields (the `halfmoon sim` flags given)."""
    block_size = changes.get("block_size", _SERVE.engine.block_size)
    tiers = tier_tokens(dataclasses.replace(_SERVE.engine, block_size=block_size), kv_bytes_per_token)
    served = {"device_tokens": tiers.device, "host_tokens": tiers.host, "disk_tokens": tiers.disk,
              "admission": serve_admission()}
    return SimConfig(**(served | changes))  # type: ignore[arg-type]


@dataclass(slots=True)
class Record:
    """What happened to one request (s; ttft/tbt from its arrival, arrival/end from the replay's start)."""

    index: int
    arrival_s: float
    prompt_len: int
    output_len: int
    status: str = "pending"  # ok / rejected / error / timeout
    reason: str | None = None
    ttft_s: float | None = None
    tbt_s: float | None = None
    cached_tokens: tuple[int, int, int] = (0, 0, 0)  # served by device / host / disk
    predicted_ttft_ms: float | None = None
    predicted_tbt_ms: float | None = None
    end_s: float | None = None
    adapter: str = ""  # its LoRA adapter ("" = the base model)


@dataclass(frozen=True, slots=True)
class SimResult:
    config: SimConfig
    workload: Workload
    records: tuple[Record, ...]
    busy_s: dict[str, float]  # per worker
    makespan_s: float
    wall_s: float
    adapter_loads: dict[str, tuple[int, int]] = field(default_factory=dict)  # per worker: LoRA loads, evictions


class SpeculativeCost:
    """A cost model whose decode step is one token-time of a speculating worker: a step of b
    requests verifying t tokens each costs the rows of b x t, and emits t tokens a request, so
    per token it costs est_decode_step_ms(b x t, context) / t. Prefill is unchanged."""

    def __init__(self, cost: CostModel, tokens_per_step: float) -> None:
        self.cost, self.tokens_per_step = cost, tokens_per_step

    def est_decode_step_ms(self, batch: int, context_tokens: int) -> float:
        t = self.tokens_per_step
        return self.cost.est_decode_step_ms(round(batch * t), context_tokens) / t

    def __getattr__(self, name: str) -> object:  # everything else is the wrapped model's
        return getattr(self.cost, name)


class Simulator:
    """One replay of a workload through one cluster shape (module docstring)."""

    def __init__(self, config: SimConfig, cost: CostModel, after: Simulator | None = None) -> None:
        """A fresh cluster; `after`: one whose replay ended, whose Conductor (the dispatcher: its
        calibration, output-length estimates) and clock go on here, as a live server's do from
        one replay to the next (its workers and caches are fresh: a new replay's prefixes are
        new to them, as a live replay under its own cache salt)."""
        if config.overhead_ms is None:  # the cost model's (measured by serve at start)
            config = dataclasses.replace(config, overhead_ms=cost.overhead_ms)
        self.config = config
        self.cost = cost
        if config.cores is not None:  # the sharing is timed by `Cores`, not by the scale too
            cost = dataclasses.replace(cost, prefill_scale=unshared_scale(cost.prefill_scale, config))
        if config.tokens_per_step != 1.0:  # the workers' steps: one token-time each
            cost = SpeculativeCost(cost, config.tokens_per_step)  # type: ignore[assignment]
        self.clock = after.clock if after is not None else Clock()
        self.start_s = self.clock.now  # the replay's time 0
        chunk = config.chunk if config.colocated else None
        clock = self.clock
        self.dispatcher = (after.dispatcher if after is not None else
                           Dispatcher(config.admission, self.cost, config.block_size, chunk, clock=lambda: clock.now,
                                      prefill_budget=None if config.colocated else config.chunk,
                                      prefill_max_seqs=config.prefill_max_seqs))
        self.records: list[Record] = []
        blocks = config.device_tokens // config.block_size
        self.prefill: dict[str, PrefillWorker] = {}
        self.decode: dict[str, DecodeWorker] = {}
        self._worker_cost = cost  # the workers' (per token-time when speculating)
        self.cores = Cores(config.cores)
        if config.colocated:
            self.engine = ColocatedWorker("engine", cost, self.clock, self._cache(), config.chunk,
                                          config.max_seqs, self._first, self._finished, self._slots(), self.cores)
            self.pending, self.bound = PrefillLedger(), DecodeLedger(blocks, tokens_per_step=config.tokens_per_step)
        else:
            self.prefill_ledgers: dict[str, PrefillLedger] = {}
            self.decode_ledgers: dict[str, DecodeLedger] = {}
            for i in range(config.prefill):
                self.add_prefill(f"prefill-{i}")
            for i in range(config.decode):
                self.add_decode(f"decode-{i}")
        self._flights: dict[int, tuple[Flight, str]] = {}  # running: request index -> (flight, decode id)
        self._tick: Callable[[int], None] | None = None
        # equal deadlines are served in admission order, as the ledger's and the engine's queues
        self._admitted = itertools.count()
        # the cluster backend's admission window; co-located decides each request as it arrives
        self.window = AdmissionWindow(0.0 if config.colocated else config.admission.admit_window_ms,
                                      lambda delay, fn: clock.at(clock.now + delay, fn))

    def add_prefill(self, wid: str) -> None:
        """A fresh prefill worker (empty caches) and the Conductor's ledger of it."""
        cost, config = self._worker_cost, self.config
        self.prefill[wid] = PrefillWorker(wid, cost, self.clock, self._cache(), config.kv_tail, self._pushed,
                                          PrefillSteps(cost, config.chunk, config.prefill_max_seqs), self._slots(),
                                          self.cores)
        self.prefill_ledgers[wid] = PrefillLedger()

    def add_decode(self, wid: str) -> None:
        """A fresh decode worker and the Conductor's ledger of it."""
        config = self.config
        self.decode[wid] = DecodeWorker(wid, self._worker_cost, self.clock, config.max_seqs, self._first, self._finished,
                                        self.cores)
        self.decode_ledgers[wid] = DecodeLedger(config.device_tokens // config.block_size,
                                                tokens_per_step=config.tokens_per_step)

    @property
    def _overhead_s(self) -> float:
        return (self.config.overhead_ms or 0.0) / 1e3

    def _slots(self) -> AdapterSlots:
        return AdapterSlots(self.config.max_loras, self.config.adapter_load_ms)

    def _cache(self) -> TieredCache:
        return TieredCache(self.config.capacity(), HASH_BLOCK_TOKENS, engine_block=self.config.block_size)

    # ------------------------------------------------------------------ run

    def run(self, workload: Workload, tick: Callable[[int], None] | None = None) -> SimResult:
        """Replay `workload`; `tick(n)` is told every TICK arrivals (a progress bar)."""
        start = time.perf_counter()
        self._tick = tick
        for request in workload.requests:
            record = Record(request.index, request.arrival_s, request.prompt_len, request.output_len,
                            adapter=request.adapter)
            self.records.append(record)
            self.clock.at(self.start_s + request.arrival_s, lambda r=request: self._arrive(r))
        self.clock.run()
        self._cut(workload)
        self.check_integrity()
        workers = [*self.prefill.values(), *self.decode.values()] or [self.engine]
        makespan = max((r.end_s for r in self.records if r.end_s is not None), default=0.0)
        slotted = [*self.prefill.values()] or [self.engine]
        return SimResult(self.config, workload, tuple(self.records), {w.worker_id: w.busy_s for w in workers},
                         makespan, time.perf_counter() - start,
                         {w.worker_id: (w.adapters.loads, w.adapters.evictions) for w in slotted})

    def _cut(self, workload: Workload) -> None:
        """Requests finishing after window + drain count as cut off, as the live replay's deadline."""
        if self.config.drain_s is None:
            return
        deadline = workload.duration_s + self.config.drain_s
        for r in self.records:
            if r.status == "ok" and r.end_s is not None and r.end_s > deadline:
                r.status, r.reason = "timeout", "replay deadline"

    # ------------------------------------------------------------------ requests

    def _arrive(self, request: SimRequest) -> None:
        """Held by the admission window (the Conductor's: conductor/admission_window.py), then
        decided on the ledgers as they are then."""
        if self._tick is not None and request.index % TICK == TICK - 1:
            self._tick(TICK)
        ask = Ask(f"r{request.index}", request.prompt_len, request.output_len, None, Slo())
        if self.config.colocated:
            prefix = PrefixMatch({}, self._cached_tokens(self.engine.cache, request))
        else:
            prefix = self._prefix(request)
        rank, prefill_ms = self.dispatcher.window_key(ask, prefix)
        arrival = self.clock.now
        self.window.hold(rank, prefill_ms, lambda final: self._decide(request, ask, arrival, final))

    def _decide(self, request: SimRequest, ask: Ask, arrival: float, final: bool = True) -> None:
        """As the Conductor decides; not `final`, a refusal may raise SecondLook (the window keeps it)."""
        record = self.records[request.index]
        now = self.clock.now
        self._sync_generated()
        try:
            if self.config.colocated:
                cached = self._cached_tokens(self.engine.cache, request)
                booking = self.dispatcher.dispatch_colocated(ask, cached, self.pending, self.bound, now, arrival)
            else:
                booking = self.dispatcher.dispatch(ask, self._prefix(request), self._prefill_sides(),
                                                   self._decode_sides(), now, arrival, final)
        except OverloadedError as e:
            record.status, record.reason = "rejected", e.reason or "overloaded"
            record.end_s = self._now()
            return
        except ServiceUnavailableError as e:
            record.status, record.reason, record.end_s = "error", str(e), self._now()
            return
        prediction = booking.decision.prediction
        record.predicted_ttft_ms, record.predicted_tbt_ms = prediction.predicted_ttft_ms, prediction.predicted_tbt_ms
        flight = Flight(request, booking, (-booking.objective.rank, booking.deadline, next(self._admitted)),
                        prefix_tokens=booking.prefix_tokens)
        if self.config.colocated:
            self._flights[request.index] = (flight, "engine")
            self.clock.at(now + self._overhead_s, lambda: self.engine.submit(flight))
        else:
            self._flights[request.index] = (flight, booking.decode_id)
            self.prefill[booking.prefill_id].submit(flight)

    def _now(self) -> float:
        """The replay's clock (0 = its start)."""
        return self.clock.now - self.start_s

    def _prefix(self, request: SimRequest) -> PrefixMatch:
        per_worker = {wid: self._cached_tokens(w.cache, request) for wid, w in self.prefill.items()}
        best = max(per_worker.items(), key=lambda kv: kv[1], default=("", 0))
        adapter_ms = {wid: w.adapters.load_ms for wid, w in self.prefill.items() if not w.adapters.holds(request.adapter)}
        return PrefixMatch(per_worker, best[1], best[0] if best[1] else "", adapter_ms)

    @staticmethod
    def _cached_tokens(cache: TieredCache, request: SimRequest) -> int:
        return cache.match(request.blocks, request.prompt_len).reused

    def _prefill_sides(self) -> list[PrefillSide]:
        return [PrefillSide(wid, ledger) for wid, ledger in self.prefill_ledgers.items()]

    def _decode_sides(self) -> list[DecodeSide]:
        return [DecodeSide(wid, ledger) for wid, ledger in self.decode_ledgers.items()]

    def _sync_generated(self) -> None:
        """The tokens each running request has made so far, into its booking (the Conductor
        counts them off the stream)."""
        for flight, wid in self._flights.values():
            if flight.join_step >= 0:
                worker = self.engine if self.config.colocated else self.decode[wid]
                flight.booking.bound.generated = worker.batch.generated(flight, worker.steps_done())

    def _pushed(self, flight: Flight) -> None:
        """Its prefill ended and its KV reached the decode worker."""
        self.prefill_ledgers[flight.booking.prefill_id].finish(flight.booking.request_id, self.clock.now)
        self.window.relook()  # as the Conductor: a kept request's queue ahead shrank
        joins = self.clock.now + self._overhead_s
        flight.booking.bound.joins_at = joins
        self.clock.at(joins, lambda: self.decode[flight.booking.decode_id].join(flight))

    def _first(self, flight: Flight) -> None:
        record = self.records[flight.request.index]
        record.ttft_s = self._now() - flight.request.arrival_s
        record.cached_tokens = flight.hits.tokens
        if self.config.colocated:
            self.pending.finish(flight.booking.request_id, self.clock.now)
            flight.booking.bound.joins_at = self.clock.now

    def _finished(self, flight: Flight, batch: DecodeBatch) -> None:
        record = self.records[flight.request.index]
        record.status, record.end_s = "ok", self._now()
        record.tbt_s = batch.tbt_s(flight)
        self._flights.pop(flight.request.index, None)
        booking = flight.booking
        ledger = self.bound if self.config.colocated else self.decode_ledgers[booking.decode_id]
        ledger.release(booking.request_id)
        assert record.ttft_s is not None
        self.dispatcher.finished(booking, flight.request.output_len, flight.request.output_len,
                                 record.ttft_s, record.tbt_s)

    # ------------------------------------------------------------------ checks

    def check_integrity(self) -> None:
        """After a run: every ledger empty and within its pool, every cache consistent."""
        ledgers = [self.bound] if self.config.colocated else list(self.decode_ledgers.values())
        pendings = [self.pending] if self.config.colocated else list(self.prefill_ledgers.values())
        for ledger in ledgers:
            ledger.check_integrity()
            if ledger.jobs:
                raise AssertionError(f"{len(ledger.jobs)} bookings outlived their requests")
        if any(p.depth for p in pendings):
            raise AssertionError("a prefill ledger still holds requests after the run")
        caches = [self.engine.cache] if self.config.colocated else [w.cache for w in self.prefill.values()]
        for cache in caches:
            cache.check_integrity()
            if cache.pool.num_free() != cache.pool.num_blocks:
                raise AssertionError(f"{cache.pool.num_used()} cache blocks still held after the run")


def unshared_scale(prefill_scale: float, config: SimConfig) -> float:
    """A cost model's `prefill_scale` without the core sharing it measured: the start-up burst
    runs every worker at once (prefills beside decoding steps), so its slowdown is the sharing,
    max(1, workers / cores), times what sharing does not explain (the KV streamed out layer by
    layer, the Conductor's own work: 1.1-1.3x on a 1P1D CPU, where no core is shared)."""
    assert config.cores is not None
    workers = 1 if config.colocated else config.prefill + config.decode
    return max(1.0, prefill_scale / max(1.0, workers / config.cores))


def simulate(workload: Workload, config: SimConfig, cost: CostModel) -> SimResult:
    """Replay `workload` through a fresh cluster of `config`'s shape."""
    return Simulator(config, cost).run(workload)


def simulate_series(workloads: Sequence[Workload], config: SimConfig, cost: CostModel,
                    gap_s: float = 2.0) -> list[SimResult]:
    """Replays one after another, `gap_s` apart, on one Conductor (`Simulator`'s `after`): as
    `halfmoon bench serve` replays its loads in turn on one live server."""
    results: list[SimResult] = []
    previous: Simulator | None = None
    for workload in workloads:
        if previous is not None:
            previous.clock.advance(gap_s)
        previous = Simulator(config, cost, after=previous)
        results.append(previous.run(workload))
    return results

