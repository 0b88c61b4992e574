"""The Conductor's view of its workers, whatever runs them.

A `WorkerGroup` starts the workers of a `ClusterConfig` and hands the request path one `Worker`
each: the worker's API (a `core.messages.PrefillApi` / `DecodeApi`) plus what the Conductor
tracks about it (health, restarts, load it dispatched). Ray runs them in production
(conductor/ray_workers.py); tests run the same worker classes in one process.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from conductor.ledger import DecodeLedger, PrefillLedger
from core.messages import DecodeApi, PrefillApi, WorkerLoad
from engine.config import WorkerSpec

log = logging.getLogger(__name__)

PING_TIMEOUT_S = 5.0
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
    index_health: tuple[float, int] = (0.0, 0)  # its index holder: longest beat gap (s), resyncs
    load: WorkerLoad | None = None  # its last health answer (the dashboard's figures)
    load_at: float = 0.0  # when it came (time.monotonic())
    history: deque[tuple[float, WorkerLoad]] = field(default_factory=lambda: deque(maxlen=LOAD_HISTORY))

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id


class WorkerGroup(abc.ABC):
    """Starts, watches and stops the workers; `workers` is filled by `start`."""

    def __init__(self) -> None:
        self.workers: dict[str, Worker] = {}

    @abc.abstractmethod
    def start(self, redis_url: str | None) -> None:
        """Start every worker; returns when each answered."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop every worker (and what runs them, if the group started it)."""

    def role(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.spec.role == role]

    def block_servers(self) -> dict[str, str]:
        """Worker id -> where it serves its blocks (what a prefill needs for remote prefixes)."""
        return {wid: w.block_address for wid, w in self.workers.items() if w.block_address}

    async def check_health(self) -> None:
        """Ask every worker for its load; a restarted one (new pid) is counted, its block
        address asked again, and it comes back alive."""
        await asyncio.gather(*(_check(w) for w in self.workers.values()))


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
