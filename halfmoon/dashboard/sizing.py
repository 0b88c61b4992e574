"""The sizing page's jobs: a `halfmoon sim sweep` (sim/sweep.py) over a trace the operator picked,
run in a child process at low priority so serving keeps its CPU and the GIL.

    jobs.start(request)   -> Job (validated first: a bad field is InvalidRequestError, 400)
    jobs.get(job_id)      -> Job (its progress, rows so far, and once done the best shape + Helm values)

One sweep runs at a time (a second is ConflictError, 409); the last `keep` jobs are remembered.
The child reports each finished shape on a queue; a thread of ours follows it into the Job.
"""

from __future__ import annotations

import itertools
import logging
import math
import multiprocessing as mp
import os
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from halfmoon.conductor.admission import AdmissionConfig
from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.errors import ConflictError, ResourceNotFoundError
from halfmoon.core.errors import ConfigError, InvalidRequestError
from halfmoon.dashboard.jsonable import finite
from halfmoon.sim import builtin
from halfmoon.sim.cluster import SimConfig
from halfmoon.sim.sweep import Grid, sweep
from halfmoon.sim.trace import TraceError, TraceRequest, parse_line
from halfmoon.sim.workload import build

log = logging.getLogger(__name__)

THIS_CLUSTER = "this-cluster"  # the profile the running cluster measured (its own cost model)
MAX_SHAPES = 64  # one sweep's grid at most
NICE = 10  # the child's niceness: serving first


@dataclass(frozen=True, slots=True)
class SweepRequest:
    """A validated sizing request: the trace's requests and everything the sweep needs."""

    trace: tuple[TraceRequest, ...]
    source: str
    cost: CostModel
    grid: Grid
    base: SimConfig
    speed: float


@dataclass(slots=True)
class Job:
    id: str
    total: int
    source: str
    state: str = "running"  # running | done | failed
    rows: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] | None = None
    error: str | None = None

    def view(self) -> dict[str, Any]:
        r = self.result
        return {"id": self.id, "state": self.state, "done": len(self.rows), "total": self.total,
                "source": self.source, "rows": list(self.rows), "best": r["best"] if r else None,
                "helm_values": r["helm_values"] if r else None, "error": self.error}


def parse_trace(text: str, source: str) -> tuple[TraceRequest, ...]:
    """Mooncake JSONL -> requests; a bad line is InvalidRequestError naming it."""
    try:
        rows = tuple(parse_line(line, n, source) for n, line in enumerate(text.splitlines(), start=1)
                     if line.strip())
    except TraceError as e:
        raise InvalidRequestError("trace_text", str(e)) from None
    if not rows:
        raise InvalidRequestError("trace", f"the trace ({source}) holds no request")
    return rows


def sweep_request(body: dict[str, Any], trace: tuple[TraceRequest, ...], source: str, cost: CostModel,
                  admission: AdmissionConfig, block_size: int, chunk: int) -> SweepRequest:
    """Validate the form's fields (each error names its field) into a SweepRequest."""
    workers = _int(body, "workers", 2, 64)
    device = _ints(body, "device_tokens", 1)
    host = _ints(body, "host_tokens", 0)
    ttft, tbt = _number(body, "ttft_ms", 0.0), _number(body, "tbt_ms", 0.0)
    speed = _number(body, "speed", 1e-3)
    classes = {f"{admission.default_class}_ttft_ms": ttft, f"{admission.default_class}_tbt_ms": tbt}
    try:
        grid = Grid(workers, device, host)
        base = SimConfig(device_tokens=device[0], block_size=block_size, chunk=chunk,
                         admission=replace(admission, **classes))
    except ConfigError as e:
        raise InvalidRequestError("workers", str(e)) from None
    if len(grid.shapes(base)) > MAX_SHAPES:
        raise InvalidRequestError("device_tokens", f"{len(grid.shapes(base))} shapes is more than one sweep "
                                  f"runs ({MAX_SHAPES}): fewer workers or tier sizes")
    return SweepRequest(trace, source, cost, grid, base, speed)


def _int(body: dict[str, Any], name: str, lo: int, hi: int) -> int:
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidRequestError(name, f"must be an integer in {lo}..{hi}, got {value!r}")
    return value


def _ints(body: dict[str, Any], name: str, lo: int) -> tuple[int, ...]:
    value = body.get(name)
    if not isinstance(value, list) or not value or len(value) > 8 or \
            any(isinstance(v, bool) or not isinstance(v, int) or v < lo for v in value):
        raise InvalidRequestError(name, f"must be a list of 1..8 integers >= {lo}, got {value!r}")
    return tuple(value)


def _number(body: dict[str, Any], name: str, lo: float) -> float:
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < lo:
        raise InvalidRequestError(name, f"must be a number >= {lo:g}, got {value!r}")
    return float(value)


def cost_model(profile: str, own: CostModel | None) -> CostModel:
    """`this-cluster` = the running cluster's own cost model, else a built-in GPU profile."""
    if profile == THIS_CLUSTER:
        if own is None:
            raise InvalidRequestError("profile", "this cluster has no cost model yet (still starting)")
        return own
    if profile not in builtin.names():
        raise InvalidRequestError("profile", f"{profile!r} is not a profile; one of "
                                  f"{[THIS_CLUSTER, *builtin.names()]}")
    return builtin.load(profile)


class SizingJobs:
    def __init__(self, keep: int = 8) -> None:
        self._jobs: dict[str, Job] = {}
        self._keep = keep
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._running: Job | None = None

    def start(self, request: SweepRequest) -> Job:
        with self._lock:
            if self._running is not None and self._running.state == "running":
                raise ConflictError(f"sweep {self._running.id} is still running; one runs at a time")
            job = Job(f"sweep-{next(self._ids)}", len(request.grid.shapes(request.base)), request.source)
            self._jobs[job.id] = self._running = job
            for old in list(self._jobs)[:-self._keep]:
                del self._jobs[old]
        ctx = mp.get_context("spawn")  # a fresh interpreter: no copy of the server's threads
        out = ctx.Queue()
        child = ctx.Process(target=_run_sweep, args=(request, out), name=f"halfmoon-{job.id}", daemon=True)
        child.start()
        threading.Thread(target=self._follow, args=(job, child, out), name=f"follow-{job.id}", daemon=True).start()
        return job

    def get(self, job_id: str) -> Job:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            raise ResourceNotFoundError(f"no sizing job {job_id!r}")
        return job

    def _follow(self, job: Job, child: Any, out: Any) -> None:
        """Move the child's reports into the job until it is done or the child is gone."""
        while job.state == "running":
            try:
                kind, payload = out.get(timeout=0.5)
            except queue.Empty:
                if not child.is_alive():
                    job.state, job.error = "failed", f"the sweep process exited ({child.exitcode})"
                continue
            if kind == "row":
                job.rows.append(finite(payload))
            elif kind == "done":
                job.result, job.state = finite(payload), "done"
            else:
                job.state, job.error = "failed", str(payload)
        child.join(timeout=5)


def _run_sweep(request: SweepRequest, out: Any) -> None:
    """The child: replay every shape, one report per shape, then the result (or the error)."""
    try:
        os.nice(NICE)
        workload = build(request.trace, request.speed, source=request.source)
        result = sweep(workload, request.grid, request.base, request.cost, tick=lambda row: out.put(("row", row)))
        out.put(("done", result))
    except Exception as e:  # reported to the page, not lost in the child
        out.put(("failed", f"{type(e).__name__}: {e}"))


def trace_summary(rows: Sequence[TraceRequest]) -> tuple[int, float]:
    """(requests, span in s) of a trace."""
    if not rows:
        return 0, 0.0
    return len(rows), (max(r.timestamp for r in rows) - min(r.timestamp for r in rows)) / 1e3
