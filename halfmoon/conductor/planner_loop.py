"""The planner in the Conductor: every `interval_s` it reads the traffic of the last window,
asks the planner (conductor/planner.py) for a decision, and in `act` mode applies it through an
`Actuator` (conductor/rebalance.py: drain, flip, add, remove). Every decision, made or not, is
kept for the dashboard's timeline, counted for /metrics and sent as an OpenTelemetry span with
its reason (`planner.decision`).

A tick runs on a thread (the event loop keeps serving); the live advisor replays the window in a
child process at low priority (sim/advisor.py's `ChildAdvisor`, as the sizing page's sweeps run)
so it does not hold the GIL either. While a tick or a move runs, the next tick waits.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from halfmoon.conductor.planner import Advisor, Decision, Planner, PlannerConfig, Split, Traffic
from halfmoon.core.errors import ConfigError
from halfmoon.core.tracing import NO_TRACER, Tracer, now_ns

log = logging.getLogger(__name__)

TIMELINE = 200  # decisions kept for the dashboard

if TYPE_CHECKING:  # the backend starts its planner
    from halfmoon.conductor.cluster import ClusterBackend

AdvisorFactory = Callable[["ClusterBackend"], Advisor]  # the backend's advisor, once its cost model is known


class Actuator(Protocol):
    def split(self) -> Split:
        """The prefill and decode workers serving now (draining ones not counted)."""

    async def apply(self, decision: Decision, drain_s: float) -> None:
        """Make the decision's one step (raises when it could not: the split stays)."""


@dataclass(slots=True)
class PlannerSnapshot:
    """What the dashboard and /metrics show of the planner."""

    mode: str
    interval_s: float
    split: Split
    desired: Split  # where the last decision heads (its target; the split now when holding)
    decisions: tuple[Decision, ...] = ()  # oldest first
    counts: dict[str, int] = field(default_factory=dict)  # per action, applied or advised
    failed: int = 0  # moves that could not be applied
    busy: bool = False  # a move is being applied now (a worker drains)

    def view(self) -> dict[str, object]:
        return {"mode": self.mode, "interval_s": self.interval_s, "split": str(self.split),
                "prefill": self.split.prefill, "decode": self.split.decode,
                "desired": {"prefill": self.desired.prefill, "decode": self.desired.decode},
                "decisions": [d.view() for d in self.decisions], "counts": dict(self.counts),
                "failed": self.failed, "busy": self.busy}


class PlannerLoop:
    """Ticks the planner on the Conductor's event loop (module docstring)."""

    def __init__(self, config: PlannerConfig, planner: Planner, actuator: Actuator, traffic: Traffic,
                 tracer: Tracer = NO_TRACER,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.planner = planner
        self.actuator = actuator
        self.traffic = traffic
        self.tracer = tracer
        self.clock = clock
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=TIMELINE)
        self.counts: collections.Counter[str] = collections.Counter()
        self.failed = 0
        self.busy = False
        self._task: asyncio.Task | None = None

    def start(self) -> PlannerLoop:
        if self.config.mode != "off":
            self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # a tick that failed is logged; the next one tries again
                log.exception("planner: the tick failed")

    async def tick(self) -> Decision:
        """One decision, applied in `act` mode."""
        now = self.clock()
        current = self.actuator.split()
        window = self.traffic.window(now, self.config.window_s)
        decision = await asyncio.to_thread(self.planner.tick, now, current, window)
        if decision.moves and self.config.mode == "act":
            decision = await self._apply(decision)
        self._record(decision)
        return decision

    async def _apply(self, decision: Decision) -> Decision:
        self.busy = True
        try:
            await self.actuator.apply(decision, self.config.drain_s)
        except Exception as e:  # the split stays as it was; said in the timeline
            self.failed += 1
            log.warning("planner: %s %s failed: %s", decision.action, decision.role, e)
            return replace(decision, reason=f"{decision.reason}; not applied: {e}")
        finally:
            self.busy = False
        return replace(decision, applied=True)

    def _record(self, decision: Decision) -> None:
        self.decisions.append(decision)
        self.counts[decision.action] += 1
        if decision.moves:
            log.info("planner (%s): %s%s %s -> %s: %s", self.config.mode, decision.action,
                     f" {decision.role}" if decision.role else "", decision.current, decision.next_split,
                     decision.reason)
        span = self.tracer.start("planner.decision", None, _attributes(decision, self.config.mode), start_ns=now_ns())
        span.event(f"planner.{decision.action}", {"halfmoon.planner.reason": decision.reason})
        span.end()

    def snapshot(self) -> PlannerSnapshot:
        split = self.actuator.split()
        last = self.decisions[-1] if self.decisions else None
        # where it heads: a move's target, or one waiting for confirmation; a hold for too small a
        # gain or a cooldown heads nowhere (an autoscaler reading it must not chase that target)
        heading = last is not None and (last.moves or last.waiting)
        return PlannerSnapshot(self.config.mode, self.config.interval_s, split,
                               last.target if heading else split, tuple(self.decisions),
                               dict(self.counts), self.failed, self.busy)


def _attributes(decision: Decision, mode: str) -> dict[str, str | float | bool]:
    return {"halfmoon.planner.mode": mode, "halfmoon.planner.action": decision.action,
            "halfmoon.planner.role": decision.role or "", "halfmoon.planner.current": str(decision.current),
            "halfmoon.planner.target": str(decision.target), "halfmoon.planner.next": str(decision.next_split),
            "halfmoon.planner.gain": decision.gain, "halfmoon.planner.applied": decision.applied,
            "halfmoon.planner.reason": decision.reason}


def start_planner(backend: ClusterBackend, advisor: AdvisorFactory | None) -> PlannerLoop:
    """The backend's planner, ticking: bounded by the split it started with, advised by
    `advisor(backend)`, acting through its rebalancer."""
    config = backend.config.planner
    if advisor is None:
        raise ConfigError(f"--planner {config.mode} needs an advisor (the simulator's, which `halfmoon serve` "
                          "gives the Conductor); use --planner off")
    start = backend.rebalancer.split()
    bounded = config.bounded(start)
    if config.mode == "act" and backend.config.prefill_tp != backend.config.decode_tp:
        raise ConfigError(f"--planner act flips workers between pools, which needs one tensor-parallel size "
                          f"(--prefill-tp {backend.config.prefill_tp}, --decode-tp {backend.config.decode_tp})")
    loop = PlannerLoop(bounded, Planner(bounded, advisor(backend)), backend.rebalancer, backend.traffic,
                       backend.tracer)
    log.info("planner (%s): every %g s over the last %g s of traffic, split %s within %d..%d workers",
             config.mode, config.interval_s, config.window_s, start, bounded.min_workers, bounded.max_workers)
    return loop.start()
