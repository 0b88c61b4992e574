"""The planner's hands in the live cluster (`--planner act`): one step of a decision at a time.

    flip    the least busy worker of the pool that shrinks drains, `become`s the other role and
            joins that pool (its engine, prefix cache and tiers stay: what it holds is still a
            cache hit through the index)
    add     one more worker actor of the pool that grows, started and warmed up before it serves
    remove  the least busy worker of the pool that shrinks drains and is stopped (its engine
            closed: its tiers and index entries go with it)

Draining (nothing lost): the worker leaves `WorkerGroup.role()` at once, so no new request is
routed or admitted there; the requests it has finish there for up to `drain_s`; a decode worker's
requests still running then are moved (`evicting`: each one's next chunk ends its attempt with
`WorkerDrainedError`, and the migration path re-prefills prompt + the tokens the client has on
another pair: conductor/migration.py), a prefill worker's prefills always finish (seconds). Its
ledgers are empty when it leaves, so the reservations and leases it held are released; a drain
that does not empty within `drain_s` + `MOVE_S` puts the worker back in its pool and the move
fails (the planner's timeline says so).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from halfmoon.conductor.ledger import DecodeLedger, PrefillLedger
from halfmoon.conductor.planner import Decision, Split
from halfmoon.conductor.workers import Worker
from halfmoon.core.errors import ConfigError
from halfmoon.core.messages import WorkerError, WorkerLostError
from halfmoon.core.turns import Turns

if TYPE_CHECKING:  # the backend owns the rebalancer
    from halfmoon.conductor.cluster import ClusterBackend

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a drain looks at the worker's ledgers
MOVE_S = 30.0  # after drain_s, how long evicted requests may take to leave


class RebalanceError(RuntimeError):
    """A move could not be made (the split stays as it was)."""


class WorkerDrainedError(WorkerLostError):
    """The request's decode worker is leaving its pool: the request moves (as from a lost one)."""

    def __init__(self, worker_id: str) -> None:
        WorkerError.__init__(self, f"worker {worker_id} is leaving its pool under this request; moving it")
        self.worker_id = worker_id


class Rebalancer:
    """The live cluster as the planner's `Actuator` (conductor/planner_loop.py)."""

    def __init__(self, backend: ClusterBackend) -> None:
        self.backend = backend
        self.evicting: set[str] = set()  # decode workers whose requests move at their next chunk

    def split(self) -> Split:
        group = self.backend.manager
        return Split(len(group.role("prefill")), len(group.role("decode")))

    async def apply(self, decision: Decision, drain_s: float) -> None:
        current, after = decision.current, decision.next_split
        if self.split() != current:
            raise RebalanceError(f"the split is {self.split()} now, not {current} as decided")
        if after.total == current.total:
            leaving = "decode" if after.prefill > current.prefill else "prefill"
            await self.flip(self._least_busy(leaving), "prefill" if leaving == "decode" else "decode", drain_s)
        elif after.total > current.total:
            await self.add("prefill" if after.prefill > current.prefill else "decode")
        else:
            await self.remove(self._least_busy("prefill" if after.prefill < current.prefill else "decode"), drain_s)

    async def flip(self, worker: Worker, role: str, drain_s: float) -> None:
        """Drain `worker`, make it a `role` worker and let it serve in that pool."""
        become = getattr(worker.api, "become", None)
        if become is None:
            raise ConfigError(f"worker {worker.worker_id} cannot change its role: start the cluster with "
                              "--planner act (its workers then serve either role)")
        started = time.monotonic()
        await self.drain(worker, drain_s)
        config = self.backend.config
        try:
            await become(role, config.prefill_seqs(role))
        except BaseException:
            worker.state = "ready"  # back in its old pool, as it was
            raise
        worker.spec = replace(worker.spec, role=role)
        worker.pending, worker.bound, worker.sends = PrefillLedger(), DecodeLedger(worker.total_blocks), Turns()
        worker.state = "ready"
        self.backend.learn_capacity()
        log.info("planner: worker %s flipped to %s in %.2f s", worker.worker_id, role, time.monotonic() - started)

    async def add(self, role: str) -> Worker:
        """One more `role` worker, serving once it answered and warmed up."""
        group, config = self.backend.manager, self.backend.config
        taken = {w.worker_id for w in group.everyone()}
        index = next(i for i in range(len(taken) + 1) if f"{role}-{i}" not in taken)
        spec = config.spec(role, index, len(taken), self.backend.redis_url)
        worker = await asyncio.to_thread(group.add_worker, spec)
        self.backend.learn_capacity()
        return worker

    async def remove(self, worker: Worker, drain_s: float) -> None:
        """Drain `worker`, then stop it."""
        await self.drain(worker, drain_s)
        await asyncio.to_thread(self.backend.manager.remove_worker, worker)
        self.backend.learn_capacity()

    async def drain(self, worker: Worker, drain_s: float) -> None:
        """Take `worker` out of its pool and wait until its ledgers are empty (module docstring);
        RebalanceError (and the worker back in its pool) when they do not empty in time."""
        worker.state = "draining"
        if await self._emptied(worker, drain_s):
            return
        if worker.spec.role == "decode":  # a prefill worker's prefills end by themselves
            log.info("planner: worker %s still runs %d requests after %g s: moving them",
                     worker.worker_id, len(worker.bound.jobs), drain_s)
            self.evicting.add(worker.worker_id)
        try:
            if await self._emptied(worker, MOVE_S):
                return
        finally:
            self.evicting.discard(worker.worker_id)
        worker.state = "ready"
        raise RebalanceError(f"worker {worker.worker_id} did not drain within {drain_s + MOVE_S:g} s "
                             f"({_busy(worker)}); it stays a {worker.spec.role} worker")

    async def _emptied(self, worker: Worker, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while _busy(worker):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True

    def _least_busy(self, role: str) -> Worker:
        live = [w for w in self.backend.manager.role(role) if w.alive and w.state == "ready"]
        if len(live) <= 1:
            raise RebalanceError(f"the {role} pool has {len(live)} ready worker(s): none can leave it")
        return min(live, key=lambda w: (len(w.pending.jobs) + len(w.bound.jobs), w.worker_id))


def _busy(worker: Worker) -> str:
    """What `worker` still has ("" when nothing: requests it prefills or decodes, as booked)."""
    prefilling, decoding = len(worker.pending.jobs), len(worker.bound.jobs)
    return f"{prefilling} prefilling, {decoding} decoding" if prefilling or decoding else ""
