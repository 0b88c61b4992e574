"""The Conductor's view of its workers, whatever runs them.

A `WorkerGroup` starts the workers of a `ClusterConfig` and hands the request path one `Worker`
each: the worker's API (a `core.messages.PrefillApi` / `DecodeApi`) plus what the Conductor
tracks about it (health, restarts, load it dispatched). Ray runs them in production
(conductor/ray_workers.py); tests run the same worker classes in one process.

Warm standbys (`--standby N`): `workers` holds the serving workers only (what the router,
admission and capacity see); `standbys` holds the spares, loaded and warmed, never routed to.
When a serving worker is found dead (a request's `WorkerLostError`, or a failed health check),
`promote` swaps it at once with a ready standby of its role: the standby serves under its own id
(a worker's id is its engine's identity in the cluster index and among the block servers), and
the dead worker becomes a spare. Ray restarts the dead actor in place; once it answers again it
is warmed up and becomes the new standby. So a role always has its serving count of workers in
`workers`, and Ray's restart never puts two workers in one place.

    state of a spare:    warming --(answers, warm-up ran)--> standby --(promoted)--> promoting
    state of a server:   promoting --(its next health answer)--> ready --(dies)--> warming
    the planner's moves: ready --(leaving its pool)--> draining --(flipped)--> ready in the other
                         pool, or --(removed)--> gone (conductor/rebalance.py)

A draining worker stays in `workers` (its requests finish there) but is not in `role()`: the
router, admission and capacity no longer see it. `add_worker` / `remove_worker` start and stop
one worker (the planner's adds and removes; each group knows how: `_launch`, `_shut`).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from halfmoon.conductor.ledger import DecodeLedger, PrefillLedger
from halfmoon.core.messages import DecodeApi, PrefillApi, WorkerLoad
from halfmoon.core.turns import Turns
from halfmoon.engine.config import WorkerSpec

log = logging.getLogger(__name__)

State = Literal["ready", "promoting", "standby", "warming", "draining"]

PING_TIMEOUT_S = 5.0
WARM_UP_TIMEOUT_S = 120.0  # a warm-up request on a fresh engine (kernels compile on first use)
LOAD_HISTORY = 90  # health answers kept per worker (one a second: the dashboard's last minute and a half)


@dataclass(slots=True)
class Worker:
    """One worker as the Conductor sees it."""

    spec: WorkerSpec
    api: PrefillApi | DecodeApi
    alive: bool = True
    pid: int = 0
    restarts: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    block_address: str | None = None  # where it serves its blocks to other workers
    node_id: str = ""  # the node it runs on (its index entries' node; "" until it answered)
    pending: PrefillLedger = field(default_factory=PrefillLedger)  # prefill: sent, not prefilled yet
    bound: DecodeLedger = field(default_factory=DecodeLedger)  # decode: requests and KV booked here
    sends: Turns = field(default_factory=Turns)  # prefill: tasks sent in decision order
    index_health: tuple[float, int] = (0.0, 0)  # its index holder: longest beat gap (s), resyncs
    load: WorkerLoad | None = None  # its last health answer (the dashboard's figures)
    load_at: float = 0.0  # when it came (time.monotonic())
    history: deque[tuple[float, WorkerLoad]] = field(default_factory=lambda: deque(maxlen=LOAD_HISTORY))
    state: State = "ready"  # see the module docstring

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id


class WorkerGroup(abc.ABC):
    """Starts, watches and stops the workers; `workers` is filled by `start`."""

    def __init__(self) -> None:
        self.workers: dict[str, Worker] = {}  # the serving workers
        self.standbys: dict[str, Worker] = {}  # the spares (module docstring)
        self.promotions = 0
        self._warming: dict[str, asyncio.Task] = {}

    @abc.abstractmethod
    def start(self, redis_url: str | None) -> None:
        """Start every worker; returns when each answered."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop every worker (and what runs them, if the group started it)."""

    def role(self, role: str) -> list[Worker]:
        """The serving workers of `role` (standbys and draining workers are not among them)."""
        return [w for w in self.workers.values() if w.spec.role == role and w.state != "draining"]

    def add_worker(self, spec: WorkerSpec) -> Worker:
        """Start the worker of `spec`, wait until it answers and ran a warm-up request, and
        serve it (blocking: call it off the event loop)."""
        if spec.worker_id in self.workers or spec.worker_id in self.standbys:
            raise ValueError(f"worker {spec.worker_id} exists already")
        worker = self._launch(spec)
        self.place(worker, standby=False)
        return worker

    def remove_worker(self, worker: Worker) -> None:
        """Stop a worker that serves nothing any more (drained first: conductor/rebalance.py)."""
        self.workers.pop(worker.worker_id, None)
        self._shut(worker)

    def _launch(self, spec: WorkerSpec) -> Worker:
        raise NotImplementedError(f"{type(self).__name__} cannot start workers at run time")

    def _shut(self, worker: Worker) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot stop workers at run time")

    def place(self, worker: Worker, standby: bool) -> None:
        """Add a started worker: serving, or a spare (`start` warmed it up: state standby)."""
        if standby:
            worker.state = "standby"
            self.standbys[worker.worker_id] = worker
        else:
            self.workers[worker.worker_id] = worker

    def everyone(self) -> Iterator[Worker]:
        """Serving workers and spares."""
        yield from self.workers.values()
        yield from self.standbys.values()

    def promote(self, dead: Worker) -> Worker | None:
        """Put a ready standby of `dead`'s role in its place (a no-op when `dead` is no longer
        serving or no standby is ready); the promoted worker. `dead` becomes a warming spare."""
        if self.workers.get(dead.worker_id) is not dead:
            return None
        spare = next((w for w in self.standbys.values()
                      if w.spec.role == dead.spec.role and w.state == "standby" and w.alive), None)
        if spare is None:
            return None
        del self.standbys[spare.worker_id], self.workers[dead.worker_id]
        dead.alive, dead.state = False, "warming"
        self.standbys[dead.worker_id] = dead
        spare.state = "promoting"
        self.workers[spare.worker_id] = spare
        self.promotions += 1
        log.warning("worker %s is down: standby %s promoted in its place", dead.worker_id, spare.worker_id)
        return spare

    def block_servers(self) -> dict[str, str]:
        """Worker id -> where it serves its blocks (what a prefill needs for remote prefixes)."""
        return {w.worker_id: w.block_address for w in self.everyone() if w.block_address}

    def stop_warm_ups(self) -> None:
        """Cancel the standbys' warm-ups in flight (the group is stopping)."""
        for task in self._warming.values():
            task.cancel()
        self._warming.clear()

    async def check_health(self) -> None:
        """Ask every worker, standbys included, for its load; a restarted one (new pid) is
        counted, its block address asked again, and it comes back alive. A serving worker found
        down is replaced by a standby; a promoted one that answered is ready; a spare that
        answers again is warmed up (in the background) and becomes a standby."""
        await asyncio.gather(*(_check(w) for w in list(self.everyone())))
        for w in list(self.workers.values()):
            if not w.alive:
                self.promote(w)
            elif w.state == "promoting":
                w.state = "ready"
        for w in self.standbys.values():
            if w.alive and w.state == "warming" and w.worker_id not in self._warming:
                self._warming[w.worker_id] = asyncio.create_task(self._warm_up(w))

    async def _warm_up(self, w: Worker) -> None:
        """A warm-up request through `w`'s engine, then `w` is a standby (a failure: it stays
        warming, tried again on a later health check)."""
        try:
            seconds = await asyncio.wait_for(w.api.warm_up(), WARM_UP_TIMEOUT_S)
        except Exception as e:  # died again, or hung: the next health check decides
            log.warning("standby %s: warm-up failed: %s", w.worker_id, e)
        else:
            if self.standbys.get(w.worker_id) is w and w.alive:
                w.state = "standby"
                log.info("standby %s ready (warm-up %.2f s)", w.worker_id, seconds)
        finally:
            self._warming.pop(w.worker_id, None)


async def _check(w: Worker) -> None:
    try:
        load = await asyncio.wait_for(w.api.load(), PING_TIMEOUT_S)
        pid = await asyncio.wait_for(w.api.pid(), PING_TIMEOUT_S)
        restarted = bool(w.pid) and pid != w.pid
        if restarted or w.block_address is None:  # None also while it keeps no tiers (cheap)
            w.block_address = await asyncio.wait_for(w.api.block_address(), PING_TIMEOUT_S)
    except Exception as e:  # died, restarting, or hung: routed around until it answers
        if w.alive:
            log.warning("worker %s is down: %s", w.worker_id, e)
        w.alive = False
        return
    if restarted:
        w.restarts += 1
        log.warning("worker %s was restarted (pid %d -> %d)", w.worker_id, w.pid, pid)
    w.pid, w.alive, w.free_blocks, w.total_blocks = pid, load.alive, load.free_blocks, load.total_blocks
    w.node_id = load.node_id  # a restarted actor may have landed on another node
    w.bound.total_blocks = load.total_blocks
    w.bound.observe_decode(load.decode_entries, load.decode_tokens, load.decode_single)
    w.index_health = (load.index_heartbeat_max_gap_s, load.index_resyncs)
    w.load, w.load_at = load, time.monotonic()
    w.history.append((w.load_at, load))
