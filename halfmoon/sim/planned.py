"""The planner in the simulator (issue 49): a replay whose prefill:decode split changes as the
planner (conductor/planner.py) decides, as `halfmoon serve --planner act` changes the live one.

    arrival / end --> Traffic (what the Conductor saw: lengths, met both SLOs, rejected)
    every interval_s of simulated time:
        Planner.tick(now, split, Traffic.window(now, window_s))    advisor: SimAdvisor, the
        --> hold | flip | add | remove | rollback (one step)       same config and cost model
        act: the step applied to the simulated workers, as live (conductor/rebalance.py):
          flip    a worker of the pool that shrinks drains (no longer routed); once its work is
                  done (prefill: its ledger empty, every KV pushed; decode: every booking
                  released) it is a fresh worker of the other pool under the same id (empty caches)
          add     a fresh worker of the pool joins `start_s` later (a GPU worker's start)
          remove  a worker drains, then is dropped
        advise: the decision is kept, nothing changes

A decode worker still busy `drain_s` after its drain began keeps finishing its requests (live
migrates them: conductor/migration.py); the move counts it (`Move.overran`). While a move is in
progress (a drain, a start) the planner does not tick: live, the next tick waits for the move.
The split over time is the workers taking new requests (draining and starting ones not counted).
The advisor's replays take no simulated time (live: seconds in a child process).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.dispatch import Ask, DecodeSide, PrefillSide
from halfmoon.conductor.planner import Advisor, Decision, Planner, PlannerConfig, Split, Traffic, step_toward
from halfmoon.core.errors import ConfigError
from halfmoon.sim.advisor import SimAdvisor
from halfmoon.sim.cluster import SimConfig, Simulator, SimResult
from halfmoon.sim.engines import DecodeBatch, Flight
from halfmoon.sim.report import config_objectives, met
from halfmoon.sim.workload import SimRequest, Workload

# A GPU worker's start, weights to serving: an estimate, not measured here. Llama 3 8B's 16 GB of
# BF16 weights from local NVMe at ~2 GB/s (~8 s), then vLLM-style torch.compile (cached) and
# CUDA-graph capture (~10-20 s for an 8B model), a Ray actor's start and registration (~1-2 s).
WORKER_START_S = 30.0


@dataclass(slots=True)
class Move:
    """One decision applied to the simulated workers: `worker` drains (flip, remove) or starts
    (add) at `at`; `done_at`: when it served in its new pool (flip, add) or left (remove);
    `overran`: a decode worker still finishing requests `drain_s` after its drain began."""

    at: float
    action: str
    role: str
    worker: str
    before: Split
    after: Split
    done_at: float | None = None
    overran: bool = False


class PlannedResult(NamedTuple):
    """A planned replay: the replay itself, every decision (applied or advised), the moves made,
    the split over time ((s, split) at 0 and at each change) and the ticks skipped while a move
    was in progress."""

    result: SimResult
    decisions: tuple[Decision, ...]
    splits: tuple[tuple[float, Split], ...]
    moves: tuple[Move, ...] = ()
    skipped: int = 0

    @property
    def final_split(self) -> Split:
        return self.splits[-1][1]


class PlannedSimulator(Simulator):
    """A `Simulator` whose split the planner changes (module docstring)."""

    def __init__(self, config: SimConfig, cost: CostModel, planner: PlannerConfig,
                 advisor: Advisor | None = None, start_s: float = WORKER_START_S) -> None:
        if config.colocated:
            raise ConfigError("the planner splits prefill and decode pools: not a co-located engine")
        super().__init__(config, cost)
        start = Split(config.prefill, config.decode)
        self.plan = planner.bounded(start)
        self.planner = Planner(self.plan, advisor or SimAdvisor(config, cost)) if planner.mode != "off" else None
        self.start_worker_s = start_s
        self.traffic = Traffic(keep_s=self.plan.window_s)
        self.slo_ms = config_objectives(config)
        self.leaving: dict[str, Move] = {}  # draining worker -> its move
        self.decisions: list[Decision] = []
        self.moves: list[Move] = []
        self.splits: list[tuple[float, Split]] = [(0.0, start)]
        self.skipped = 0
        self._moving: Move | None = None
        self._next_id = config.prefill + config.decode
        self._retired_busy: dict[str, float] = {}

    # ------------------------------------------------------------------ the replay

    def run_planned(self, workload: Workload) -> PlannedResult:
        """Replay `workload`, the planner ticking every interval until its last arrival."""
        if self.planner is not None:
            interval, t = self.plan.interval_s, self.plan.interval_s
            while t <= workload.duration_s:
                self.clock.at(self.start_s + t, self._plan_tick)
                t += interval
        result = self.run(workload)
        busy = dict(result.busy_s)
        for wid, seconds in self._retired_busy.items():
            busy[wid] = busy.get(wid, 0.0) + seconds
        return PlannedResult(dataclasses.replace(result, busy_s=busy), tuple(self.decisions), tuple(self.splits),
                             tuple(self.moves), self.skipped)

    def split(self) -> Split:
        """The workers taking new requests (draining ones not counted)."""
        return Split(sum(w not in self.leaving for w in self.prefill), sum(w not in self.leaving for w in self.decode))

    def _plan_tick(self) -> None:
        assert self.planner is not None
        now = self._now()
        if self._moving is not None:
            self.skipped += 1
            return
        current = self.split()
        decision = self.planner.tick(now, current, self.traffic.window(now, self.plan.window_s))
        if decision.moves and self.plan.mode == "act":
            self._apply(decision)
            decision = dataclasses.replace(decision, applied=True)
        self.decisions.append(decision)

    # ------------------------------------------------------------------ moves

    def _apply(self, decision: Decision) -> None:
        """The decision's one step (a rollback's too: the step back toward its target)."""
        action, role = step_toward(decision.current, decision.target)
        now = self._now()
        if action == "add":
            wid = f"{role}-{self._next_id}"
            self._next_id += 1
        else:  # the worker of the pool that shrinks holding the fewest requests
            pool = self.decode if (action == "flip") == (role == "prefill") else self.prefill
            wid = min((w for w in pool if w not in self.leaving), key=lambda w: (self._load(w), w))
        move = self._moving = Move(now, action, role, wid, decision.current, decision.next_split)
        self.moves.append(move)
        if action == "add":
            self.clock.at(self.clock.now + self.start_worker_s, lambda: self._started(move))
            return
        self.leaving[wid] = move
        self._changed()
        self.clock.at(self.clock.now + self.plan.drain_s, lambda: self._overran(move))
        self._drained(wid)  # an idle worker moves at once

    def _load(self, wid: str) -> int:
        """The requests a worker holds (the one holding fewest drains first)."""
        if wid in self.prefill:
            return self.prefill_ledgers[wid].depth
        return len(self.decode_ledgers[wid].jobs)

    def _overran(self, move: Move) -> None:
        if move.done_at is None and move.worker in self.decode:
            move.overran = True

    def _drained(self, wid: str) -> None:
        """A leaving worker whose work is done changes pool (flip) or leaves (remove)."""
        move = self.leaving.get(wid)
        if move is None or self._load(wid):
            return
        del self.leaving[wid]
        if wid in self.prefill:
            worker = self.prefill.pop(wid)
            self.prefill_ledgers.pop(wid)
            worker.cache.check_integrity()
        else:
            worker = self.decode.pop(wid)
            ledger = self.decode_ledgers.pop(wid)
            ledger.check_integrity()
            assert not worker.batch.running, f"{wid} left with requests running"
        self._retired_busy[wid] = self._retired_busy.get(wid, 0.0) + worker.busy_s
        if move.action == "flip":
            self._add(move.role, wid)
        self._done(move)

    def _started(self, move: Move) -> None:
        self._add(move.role, move.worker)
        self._done(move)

    def _add(self, role: str, wid: str) -> None:
        if role == "prefill":
            self.add_prefill(wid)
        else:
            self.add_decode(wid)

    def _done(self, move: Move) -> None:
        move.done_at = self._now()
        self._moving = None
        self._changed()

    def _changed(self) -> None:
        split, now = self.split(), self._now()
        if self.splits[-1][0] == now and len(self.splits) > 1:  # two changes at one instant: the last
            self.splits.pop()
        if split != self.splits[-1][1]:
            self.splits.append((now, split))

    # ------------------------------------------------------------------ the Conductor's view

    def _prefill_sides(self) -> list[PrefillSide]:
        return [PrefillSide(w, ledger) for w, ledger in self.prefill_ledgers.items() if w not in self.leaving]

    def _decode_sides(self) -> list[DecodeSide]:
        return [DecodeSide(w, ledger) for w, ledger in self.decode_ledgers.items() if w not in self.leaving]

    def _arrive(self, request: SimRequest) -> None:
        self.traffic.arrived(f"r{request.index}", self._now(), request.prompt_len, request.output_len)
        super()._arrive(request)

    def _decide(self, request: SimRequest, ask: Ask, arrival: float, final: bool = True) -> None:
        super()._decide(request, ask, arrival, final)  # a SecondLook raised: decided again later
        record = self.records[request.index]
        if record.status in ("rejected", "error"):
            self.traffic.ended(f"r{request.index}", 0, met=False, rejected=True)

    def _pushed(self, flight: Flight) -> None:
        super()._pushed(flight)
        self._drained(flight.booking.prefill_id)

    def _finished(self, flight: Flight, batch: DecodeBatch) -> None:
        super()._finished(flight, batch)
        record = self.records[flight.request.index]
        self.traffic.ended(f"r{record.index}", record.output_len, met(record, *self.slo_ms))
        self._drained(flight.booking.decode_id)


def simulate_planned(workload: Workload, config: SimConfig, cost: CostModel, planner: PlannerConfig,
                     advisor: Advisor | None = None, start_s: float = WORKER_START_S) -> PlannedResult:
    """Replay `workload` from `config`'s split with the planner deciding every interval (module
    docstring); `advisor`: default a `SimAdvisor` over `config` and `cost`. Mode off: the replay
    `simulate` makes, no decision."""
    return PlannedSimulator(config, cost, planner, advisor, start_s).run_planned(workload)
