"""The offline optimum: the most requests of a replay any admission policy could have served
within both SLOs, for a cost model and a cluster shape (issue 38). Admission policies are
reported as a % of it.

The reference model (`Reference`; the optimum is exact for this model):

    arrival a_i --> prefill worker w: FCFS among the admitted, one at a time, never preempted
                    start = max(a_i, w free), end = start + prefill_ms_i
                --> ready_i = end + handoff_ms_i (the KV tail, the RPCs)
                --> decode worker v: present over [ready_i, ready_i + out_i x lone_i)
                    lone_i = the cost model's step of i alone (the fastest it can decode)
    step(t)   = est_decode_step_ms(requests present at t, their prompt tokens)
    TTFT_i    = ready_i + step(ready_i) - a_i                  (the first token rides a step)
    TBT_i     = Mooncake's: the mean of the longest tenth of i's out_i - 1 gaps, gap g being
                step(ready_i + g x lone_i)

    KV        = the blocks of the requests present at t, at most `kv_blocks` per decode worker

A request is served when TTFT_i <= ttft_ms and TBT_i <= tbt_ms; the optimum picks which to admit
and, per admitted request, its prefill and decode worker. Admitting a request only adds load
(later in every prefill queue, never shortening a step), so a set that misses an objective stays
missing with more requests in it; more workers never lower the optimum (leave one idle).

Prefix hits (`Job.hits`): a request's prefill is its cold one (`Job.cold_ms`) unless an earlier
request whose prompt shares its prefix was admitted: an admission policy cannot cache what it
refused. A request a later one's prefix hit could come from may also be admitted only to
*warm* the cache (`Optimum.warmed`: its prefill runs, it is not served nor counted; a live
policy does this when it admits a request that then misses, or one that misses alone on idle
workers). Segments (below) that a hit
links are searched as one, so the choice is exact; outside a `window_bound` run every earlier
request counts as admitted (optimistic). A job without `hits` has the one prefill `prefill_ms`
(its best).

The model is optimistic wherever the simulator or a live server has a choice of its own:
stays as short as a lone request's, contexts at their prompt, KV held only while decoding
(a live decode worker books it from admission on), caches that never evict, no prefix fetch.
A request that misses even alone is never admitted, so never warms the cache for a later one. It is the yardstick,
not a proof: a step boundary can shift which requests share a step, so a policy could in
principle beat it; the report would show > 100%.

How it is computed (`solve`): requests that cannot be served even alone are dropped; the rest
split into independent *segments* wherever every earlier request's latest possible end
(a_j + ttft + (out_j - 1) x lone_j) is at or before the next arrival, and each segment is searched
by branch and bound in arrival order (admit to each distinct worker pair, or refuse; a node's
bound: served so far + a prefill-only bound of the rest, `rest_bound`). A segment whose search
ends within `node_budget` nodes is exact. One that runs out reports an upper bound of its
optimum, the least of three: the largest bound of the nodes left open; `window_bound` (runs of
`window` requests, each searched on an idle cluster); the prefill-only program over the whole
segment. `exact` is then False for the whole replay, and `schedule`, the best one found, says
how far below the bound the optimum can be. Under heavy overload where the decode KV pool binds
(which no node bound sees), the two can lie far apart: the report shows both.

A time budget (`seconds`, wall clock, for all segments together) bounds the search as well: each
segment in turn gets the time left times its share of the requests left (what a segment that
ends early leaves passes on), `SEARCH_SHARE` of it for its search and the rest for its
`window_bound` (which then searches runs of half its window first, far cheaper); a
search or window still open when its time is up stops as one out of nodes does, with the bound
its open nodes give (`Optimum.timed_out` counts the segments the clock cut). A search that
has yet to reach its first schedule (the greedy dive) may go on into the window bound's time.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import NamedTuple, Protocol

import numpy as np

from halfmoon.sim.optimum_bounds import Timeline, rest_bound

DEFAULT_NODE_BUDGET = 100_000
DEFAULT_WINDOW = 16  # requests per run of `window_bound`
BEAT_NODES = 512  # nodes between a search's beats (`Progress.beat`)
SEARCH_SHARE = 0.5  # of a segment's time, with a time budget: its search's (the rest: `window_bound`)


Beat = Callable[[], None]


class StepCost(Protocol):
    def est_decode_step_ms(self, batch: int, context_tokens: int) -> float: ...


@dataclass(frozen=True, slots=True)
class Job:
    """One request as the optimum sees it (times in ms from the replay's start).

    prefill_ms: its prefill on an idle worker at its best prefix hit (what the bounds use).
    handoff_ms: end of prefill -> its KV on the decode worker (KV tail, RPC overhead).
    kv_blocks: the KV blocks it holds on the decode worker (prompt + output).
    cold_ms: its prefill with no earlier request of the replay admitted (None: `prefill_ms`).
    hits: (earlier job, its prefill if that job was admitted), cheapest first (module docstring).
    """

    arrival_ms: float
    prompt_tokens: int
    output_tokens: int
    prefill_ms: float
    handoff_ms: float = 0.0
    kv_blocks: int = 0
    cold_ms: float | None = None
    hits: tuple[tuple[int, float], ...] = ()

    def prefill_given(self, admitted: Callable[[int], bool]) -> float:
        """Its prefill when `admitted(j)` says which earlier jobs were admitted."""
        return next((ms for j, ms in self.hits if admitted(j)),
                    self.prefill_ms if self.cold_ms is None else self.cold_ms)

    def __post_init__(self) -> None:
        for name in ("arrival_ms", "prompt_tokens", "prefill_ms", "handoff_ms", "kv_blocks"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Job.{name} must be >= 0, got {getattr(self, name)}")
        if self.output_tokens < 1:
            raise ValueError(f"Job.output_tokens must be >= 1, got {self.output_tokens}")


@dataclass(frozen=True, slots=True)
class Reference:
    """The cluster the optimum schedules: workers per role, the SLOs, the decode step cost, and
    the KV blocks of each decode worker (inf: unbounded)."""

    prefill: int
    decode: int
    ttft_ms: float
    tbt_ms: float
    cost: StepCost
    kv_blocks: float = math.inf

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError(f"the reference needs >= 1 worker per role, got {self.prefill}P{self.decode}D")
        if not (self.ttft_ms > 0 and self.tbt_ms > 0):
            raise ValueError(f"SLOs must be > 0 ms (inf = none), got {self.ttft_ms}, {self.tbt_ms}")

    def lone_ms(self, job: Job) -> float:
        """Its decode step alone: the fastest it can decode."""
        return self.cost.est_decode_step_ms(1, job.prompt_tokens)


class Stay(NamedTuple):
    """An admitted request on a decode worker: present over [ready_ms, end_ms)."""

    job: int
    arrival_ms: float
    ready_ms: float
    end_ms: float
    context: int
    output: int
    lone_ms: float
    blocks: int


class Placed(NamedTuple):
    """An admitted request of a schedule: its index in the jobs, its prefill and decode worker."""

    job: int
    prefill: int
    decode: int


class Optimum(NamedTuple):
    """served: the optimum (exact) or an upper bound of it; schedule: the best one found (a lower
    bound: as many as `served` when exact), in arrival order; warmed: the requests that schedule
    prefills without serving them, for a later one's prefix (`Placed.decode` -1)."""

    served: int
    exact: bool
    schedule: tuple[Placed, ...]
    segments: int
    inexact_segments: int
    nodes: int
    warmed: tuple[Placed, ...] = ()
    timed_out: int = 0  # of the inexact segments, those the time budget cut
    seconds: float = 0.0  # wall clock the search took
    node_budget: int = DEFAULT_NODE_BUDGET
    time_budget_s: float = math.inf  # inf: no time limit

    @property
    def admitted(self) -> frozenset[int]:
        return frozenset(p.job for p in self.schedule)

    @property
    def method(self) -> str:
        return "exact" if self.exact else "upper bound"


# ---------------------------------------------------------------------- the model


def stay(ref: Reference, index: int, job: Job, prefill_end_ms: float) -> Stay:
    ready = prefill_end_ms + job.handoff_ms
    lone = ref.lone_ms(job)
    return Stay(index, job.arrival_ms, ready, ready + job.output_tokens * lone, job.prompt_tokens,
                job.output_tokens, lone, job.kv_blocks)


def step_at(ref: Reference, members: Sequence[Stay], t: float) -> float:
    """The decode step at `t` of the requests present then (0 when none is), by definition;
    `Load` computes the same per piece."""
    present = [m for m in members if m.ready_ms <= t < m.end_ms]
    return ref.cost.est_decode_step_ms(len(present), sum(m.context for m in present)) if present else 0.0


class Load:
    """A decode worker's load over time: constant between the moments anyone joins or leaves
    (`times`), so the step and the KV held are kept per piece."""

    def __init__(self, ref: Reference, members: Sequence[Stay]) -> None:
        change: dict[float, tuple[int, int, int]] = {}
        for m in members:
            for t, sign in ((m.ready_ms, 1), (m.end_ms, -1)):
                b, k, kv = change.get(t, (0, 0, 0))
                change[t] = (b + sign, k + sign * m.context, kv + sign * m.blocks)
        self.times = sorted(change)
        self.step: list[float] = []
        self.blocks: list[int] = []
        b = k = kv = 0
        for t in self.times:
            db, dk, dkv = change[t]
            b, k, kv = b + db, k + dk, kv + dkv
            self.step.append(ref.cost.est_decode_step_ms(b, k) if b else 0.0)
            self.blocks.append(kv)

    def piece(self, t: float) -> int:
        """The piece holding `t` (t at or after the first join)."""
        return bisect.bisect_right(self.times, t) - 1

    def tbt_ms(self, s: Stay) -> float:
        """`s`'s Mooncake TBT (0 for a single token): its gaps counted per piece, not per token."""
        gaps = s.output - 1
        if gaps <= 0:
            return 0.0
        pieces: list[tuple[float, int]] = []
        for j in range(self.piece(s.ready_ms), self.piece(s.end_ms)):
            lo, hi = max(self.times[j], s.ready_ms), min(self.times[j + 1], s.end_ms)
            first = max(1, math.ceil((lo - s.ready_ms) / s.lone_ms))
            last = min(gaps, math.ceil((hi - s.ready_ms) / s.lone_ms) - 1)
            if last >= first:
                pieces.append((self.step[j], last - first + 1))
        top, total, taken = max(1, gaps // 10), 0.0, 0
        for value, count in sorted(pieces, reverse=True):
            take = min(count, top - taken)
            total, taken = total + value * take, taken + take
            if taken == top:
                break
        return total / top

    def meets(self, ref: Reference, s: Stay) -> bool:
        """Both objectives, and room for its KV when it joins (`s` is one of the members). The
        KV held only grows when someone joins, so every member's join checks the worker."""
        j = self.piece(s.ready_ms)
        ttft = s.ready_ms + self.step[j] - s.arrival_ms
        return ttft <= ref.ttft_ms and self.blocks[j] <= ref.kv_blocks and self.tbt_ms(s) <= ref.tbt_ms


def tbts_ms(load: Load, members: Sequence[Stay]) -> np.ndarray:
    """`Load.tbt_ms` of several members at once: gaps per (member, piece), then each member's
    longest tenth taken from the pieces in falling step order."""
    t, step = np.asarray(load.times), np.asarray(load.step[:-1])
    ready, end, lone, gaps = (np.array([getattr(m, f) for m in members], dtype=np.float64)[:, None]
                              for f in ("ready_ms", "end_ms", "lone_ms", "output"))
    gaps = gaps - 1
    lo, hi = np.maximum(t[:-1], ready), np.minimum(t[1:], end)
    first = np.maximum(1.0, np.ceil((lo - ready) / lone))
    last = np.minimum(gaps, np.ceil((hi - ready) / lone) - 1)
    order = np.argsort(-step, kind="stable")
    counts = np.clip(last - first + 1, 0, None)[:, order]
    top = np.maximum(1.0, np.floor(gaps / 10))
    taken = np.minimum(np.cumsum(counts, axis=1), top)
    used = np.diff(taken, axis=1, prepend=0.0)
    return np.where(gaps[:, 0] > 0, (used * step[order]).sum(axis=1) / top[:, 0], 0.0)


def meets(ref: Reference, s: Stay, members: Sequence[Stay]) -> bool:
    """`s` meets both objectives on a decode worker holding `members` (`s` among them)."""
    return Load(ref, members).meets(ref, s)


def evaluate(ref: Reference, jobs: Sequence[Job], plan: Sequence[tuple[int, int] | None]) -> bool:
    """Whether every admitted request meets both objectives: plan[i] is (prefill worker, decode
    worker), (prefill worker, -1) (prefilled to warm the cache, not served) or None (refused).
    The model's definition, whole: the tests' brute force."""
    free = [0.0] * ref.prefill
    decode: list[list[Stay]] = [[] for _ in range(ref.decode)]
    for i, (job, where) in enumerate(zip(jobs, plan, strict=True)):
        if where is None:
            continue
        w, v = where
        free[w] = max(free[w], job.arrival_ms) + job.prefill_given(lambda j: plan[j] is not None)
        if v >= 0:
            decode[v].append(stay(ref, i, job, free[w]))
    return all(Load(ref, members).meets(ref, s) for members in decode for s in members)


# ---------------------------------------------------------------------- the search


class Node(NamedTuple):
    next: int  # position in the segment of the next request to decide
    served: tuple[Placed, ...]
    free: tuple[float, ...]  # per prefill worker
    decode: tuple[tuple[Stay, ...], ...]  # per decode worker
    bound: int
    warm: tuple[Placed, ...] = ()  # prefilled only, for a later request's prefix


class Segment:
    """Branch and bound over one independent segment (module docstring)."""

    def __init__(self, ref: Reference, jobs: Sequence[Job], indexes: Sequence[int], budget: int,
                 warmers: frozenset[int] = frozenset(), unservable: frozenset[int] = frozenset(),
                 stop_at: float = math.inf, dive_by: float = -math.inf, beat: Beat | None = None) -> None:
        self.ref, self.jobs, self.indexes, self.budget = ref, jobs, list(indexes), budget
        self.stop_at = stop_at  # time.monotonic() past which the search stops as out of budget
        self.dive_by = max(stop_at, dive_by)  # ... or, before its first schedule, this one
        self.found = False  # a schedule of the whole segment (a leaf) was reached
        self.beat = beat  # called every BEAT_NODES nodes (a progress bar's chance to show)
        self.timed_out = False  # the clock, not the node budget, stopped it
        self.warmers = warmers  # may be prefilled for a later prefix only (module docstring)
        self.unservable = unservable  # of them, those that cannot be served even alone
        self.inside = frozenset(self.indexes)  # an earlier request outside counts as admitted (optimistic)
        self.deadline = [-math.inf if i in unservable else
                         jobs[i].arrival_ms + ref.ttft_ms - jobs[i].handoff_ms - ref.lone_ms(jobs[i])
                         for i in self.indexes]
        self.times = Timeline(jobs, self.indexes, self.deadline)
        self.best: tuple[Placed, ...] = ()
        self.best_warm: tuple[Placed, ...] = ()
        self.nodes = 0

    def solve(self) -> tuple[int, bool]:
        """(the optimum or, out of budget, an upper bound of it; exact)."""
        root_free, root_decode = (0.0,) * self.ref.prefill, ((),) * self.ref.decode
        stack = [Node(0, (), root_free, root_decode, self._bound(0, root_free))]
        while stack:
            node = stack.pop()
            if node.bound <= len(self.best):
                continue
            self.timed_out = self.nodes < self.budget and time.monotonic() >= (
                self.stop_at if self.found else self.dive_by)
            if self.nodes >= self.budget or self.timed_out:
                return max(len(self.best), node.bound, *(n.bound for n in stack)), False
            self.nodes += 1
            if self.beat is not None and self.nodes % BEAT_NODES == 0:
                self.beat()
            if node.next == len(self.indexes):
                self.best, self.best_warm, self.found = node.served, node.warm, True
                continue
            stack.extend(reversed(self._children(node)))  # admissions first: good schedules early
        return len(self.best), True

    def prefill_bound(self) -> int:
        """The prefill side's bound of the whole segment (`rest_bound` with no horizon)."""
        return rest_bound(self.jobs, self.indexes, self.deadline, (0.0,) * self.ref.prefill, len(self.indexes),
                          self.times.fits(0, 0.0))

    def _children(self, node: Node) -> list[Node]:
        k, i = node.next, self.indexes[node.next]
        job = self.jobs[i]
        decode = tuple(tuple(m for m in members if m.end_ms > job.arrival_ms) for members in node.decode)
        twins = self._twins(decode)
        prefill = self._prefill(job, node)
        kids = []
        for w in () if i in self.unservable else self._distinct(node.free, job.arrival_ms):
            free = node.free[:w] + (max(node.free[w], job.arrival_ms) + prefill,) + node.free[w + 1:]
            if free[w] > self.deadline[k]:
                continue
            s = stay(self.ref, i, job, free[w])
            for v in range(self.ref.decode):
                members = (*decode[v], s)
                if v not in twins and self._fits(s, members):
                    placed = decode[:v] + (members,) + decode[v + 1:]
                    served = (*node.served, Placed(i, w, v))
                    kids.append(Node(k + 1, served, free, placed, len(served) + self._bound(k + 1, free), node.warm))
        refuse = Node(k + 1, node.served, node.free, decode, len(node.served) + self._bound(k + 1, node.free),
                      node.warm)
        # warming last: a long prefill that serves nobody itself rarely pays
        warm = self._warmed(node, i, job, prefill, decode) if i in self.warmers else []
        return [*sorted(kids, key=lambda n: -n.bound), refuse, *warm]

    def _warmed(self, node: Node, i: int, job: Job, prefill: float,
                decode: tuple[tuple[Stay, ...], ...]) -> list[Node]:
        """A warmer prefilled on each distinct prefill worker (nothing decodes, nothing counted)."""
        kids = []
        for w in self._distinct(node.free, job.arrival_ms):
            free = node.free[:w] + (max(node.free[w], job.arrival_ms) + prefill,) + node.free[w + 1:]
            kids.append(Node(node.next + 1, node.served, free, decode,
                             len(node.served) + self._bound(node.next + 1, free), (*node.warm, Placed(i, w, -1))))
        return kids

    def _prefill(self, job: Job, node: Node) -> float:
        """Its prefill given what this node admitted (`Job.hits`)."""
        if not job.hits:
            return job.prefill_ms
        admitted = {p.job for p in (*node.served, *node.warm)}
        return job.prefill_given(lambda j: j in admitted or j not in self.inside)

    def _fits(self, s: Stay, members: tuple[Stay, ...]) -> bool:
        """`s` and everyone whose stay overlaps it still meet both objectives (`Load.meets`,
        their TBTs at once)."""
        ref, load = self.ref, Load(self.ref, members)
        touched = [m for m in members if m.ready_ms < s.end_ms and m.end_ms > s.ready_ms]
        for m in touched:
            j = load.piece(m.ready_ms)
            if m.ready_ms + load.step[j] - m.arrival_ms > ref.ttft_ms or load.blocks[j] > ref.kv_blocks:
                return False
        return bool(np.all(tbts_ms(load, touched) <= ref.tbt_ms))

    @staticmethod
    def _distinct(free: tuple[float, ...], arrival: float) -> list[int]:
        """One prefill worker per distinct start time (idle workers are interchangeable)."""
        seen: dict[float, int] = {}
        for w, f in enumerate(free):
            seen.setdefault(max(f, arrival), w)
        return sorted(seen.values(), key=lambda w: max(free[w], arrival))

    @staticmethod
    def _twins(decode: tuple[tuple[Stay, ...], ...]) -> set[int]:
        """Decode workers whose load equals an earlier one's (trying them again finds nothing new)."""
        seen: set[tuple[Stay, ...]] = set()
        twins = set()
        for v, members in enumerate(decode):
            key = tuple(sorted(members))
            if key in seen:
                twins.add(v)
            seen.add(key)
        return twins

    def _bound(self, k: int, free: tuple[float, ...]) -> int:
        """How many of the segment's requests from position `k` on could still be served
        (`rest_bound`)."""
        return rest_bound(self.jobs, self.indexes[k:], self.deadline[k:], free, fits=self.times.fits(k, min(free)))


def servable_alone(ref: Reference, jobs: Sequence[Job]) -> list[int]:
    """The requests that meet both objectives on an idle cluster (no other can be served)."""
    out = []
    for i, job in enumerate(jobs):
        s = stay(ref, i, job, job.arrival_ms + job.prefill_ms)
        if meets(ref, s, (s,)):
            out.append(i)
    return out


def segments(ref: Reference, jobs: Sequence[Job], indexes: Sequence[int],
             warmers: frozenset[int] = frozenset()) -> list[list[int]]:
    """`indexes` (in arrival order) split where no admitted earlier request can still be in
    the cluster: a served request ends by a_j + ttft + (out_j - 1) x lone_j; a warmer's prefill,
    queued behind all of them, by then + its cold prefill."""
    out: list[list[int]] = []
    horizon = -math.inf
    for i in indexes:
        job = jobs[i]
        if not out or job.arrival_ms >= horizon:
            out.append([])
        out[-1].append(i)
        if i in warmers:
            horizon = max(horizon, job.arrival_ms) + (job.prefill_ms if job.cold_ms is None else job.cold_ms)
        else:
            horizon = max(horizon, job.arrival_ms + ref.ttft_ms + (job.output_tokens - 1) * ref.lone_ms(job))
    return out


def linked(jobs: Sequence[Job], parts: Sequence[list[int]], servable: frozenset[int]) -> list[list[int]]:
    """`parts` with every segment a prefix hit reaches back into merged with the ones between:
    whether the earlier request is admitted changes the later one's prefill."""
    out: list[list[int]] = []
    for part in parts:
        part = list(part)
        while out:
            low = min((j for k in part for j, _ in jobs[k].hits if j in servable), default=math.inf)
            if out[-1][-1] < low:
                break
            part = out.pop() + part
        out.append(part)
    return out


class Progress(Protocol):
    """What `solve` tells a progress bar: the segments, which it searches in the order `track`
    yields them, and a beat every BEAT_NODES nodes searched (long segments included)."""

    def track(self, parts: list[list[int]]) -> Iterable[list[int]]: ...

    def beat(self) -> None: ...


class Shared(NamedTuple):
    """What every search of one `solve` shares (module docstring: warming)."""

    warmers: frozenset[int]
    unservable: frozenset[int]
    beat: Beat | None = None


class Searched(NamedTuple):
    """One segment searched (`_search`): its count, whether exact, whether the clock cut it."""

    count: int
    exact: bool
    timed_out: bool
    nodes: int
    best: tuple[Placed, ...]
    warm: tuple[Placed, ...]


def solve(ref: Reference, jobs: Sequence[Job], node_budget: int = DEFAULT_NODE_BUDGET,
          window: int = DEFAULT_WINDOW, seconds: float = math.inf, progress: Progress | None = None) -> Optimum:
    """The optimum of the reference model over `jobs` (module docstring): `node_budget` per
    segment, `seconds` of wall clock for them all (inf: no limit), told to `progress`."""
    if any(a.arrival_ms > b.arrival_ms for a, b in pairwise(jobs)):
        raise ValueError("jobs must be in arrival order")
    if not seconds >= 0:
        raise ValueError(f"the time budget must be >= 0 s (inf: none), got {seconds}")
    began = time.monotonic()
    alone = servable_alone(ref, jobs)
    warmers = _warmers(jobs, alone)
    unservable = warmers - frozenset(alone)
    parts = linked(jobs, segments(ref, jobs, sorted({*alone, *warmers}), unservable), frozenset(range(len(jobs))))
    served, schedule, warmed, inexact, timed_out, nodes = 0, [], [], 0, 0, 0
    left, end = sum(map(len, parts)), began + seconds
    shared = Shared(warmers, unservable, progress.beat if progress else None)
    for part in progress.track(parts) if progress else parts:
        now = time.monotonic()
        share = (end - now) * len(part) / left if math.isfinite(seconds) else math.inf
        left -= len(part)
        done = _search(ref, jobs, part, node_budget, window, shared, now + max(0.0, share))
        served, nodes = served + done.count, nodes + done.nodes
        schedule.extend(done.best)
        warmed.extend(done.warm)
        inexact, timed_out = inexact + (not done.exact), timed_out + done.timed_out
    return Optimum(served, inexact == 0, tuple(schedule), len(parts), inexact, nodes, tuple(warmed), timed_out,
                   time.monotonic() - began, node_budget, seconds)


def _search(ref: Reference, jobs: Sequence[Job], part: list[int], node_budget: int, window: int,
            shared: Shared, stop_at: float) -> Searched:
    """One segment by `stop_at` (time.monotonic()): the search for `SEARCH_SHARE` of the time
    left (its first schedule until `stop_at`), then, if it ran out, the window bound until
    `stop_at`."""
    now = time.monotonic()
    until = now + (stop_at - now) * SEARCH_SHARE if math.isfinite(stop_at) else math.inf
    search = Segment(ref, jobs, part, node_budget, *shared[:2], stop_at=until, dive_by=stop_at, beat=shared.beat)
    count, exact = search.solve()
    nodes, timed_out = search.nodes, search.timed_out
    if not exact:
        windows, spent, cut = window_bound(ref, jobs, part, node_budget, window, *shared, stop_at=stop_at)
        count, nodes, timed_out = min(count, windows, search.prefill_bound()), nodes + spent, timed_out or cut
    return Searched(count, exact, timed_out, nodes, search.best, search.best_warm)


def _warmers(jobs: Sequence[Job], servable: Sequence[int]) -> frozenset[int]:
    """Requests whose prefix a later servable one could use: each may be prefilled without being
    served (it cannot be served alone, or serving it would cost more than warming)."""
    return frozenset(j for k in servable for j, _ in jobs[k].hits)


def window_bound(ref: Reference, jobs: Sequence[Job], part: Sequence[int], node_budget: int,
                 window: int, warmers: frozenset[int] = frozenset(),
                 unservable: frozenset[int] = frozenset(), beat: Beat | None = None,
                 stop_at: float = math.inf) -> tuple[int, int, bool]:
    """An upper bound of a segment's optimum: cut into runs of `window` requests, each searched
    as if the cluster were idle when its first request arrives. The best schedule restricted to
    one run is a schedule of that run with less load on the cluster, so it is feasible there
    (admitting only adds load): each run's optimum is at least the best schedule's count in
    it. A run still searched at `stop_at` (time.monotonic()) counts its open nodes' bound, as
    every later one its root's; with such a deadline, runs of half the size are searched first
    (far fewer nodes), and each run counts the least of its own bound and its halves'.
    (bound, nodes searched, whether the clock cut a run)"""
    runs = [list(part[start:start + window]) for start in range(0, len(part), window)]
    shared = Shared(warmers, unservable, beat)
    if not math.isfinite(stop_at) or window < 2:
        counts, nodes, cut = _runs_bound(ref, jobs, runs, node_budget, shared, stop_at)
        return sum(counts), nodes, cut
    half = (window + 1) // 2
    halves = [[run[:half], run[half:]] if len(run) > half else [run] for run in runs]
    small, nodes, cut = _runs_bound(ref, jobs, [h for pair in halves for h in pair], node_budget, shared, stop_at)
    whole, spent, late = _runs_bound(ref, jobs, runs, node_budget, shared, stop_at)
    counts = iter(small)
    pairs = [sum(next(counts) for _ in pair) for pair in halves]
    return sum(map(min, whole, pairs)), nodes + spent, cut or late


def _runs_bound(ref: Reference, jobs: Sequence[Job], runs: Sequence[Sequence[int]], node_budget: int,
                shared: Shared, stop_at: float) -> tuple[list[int], int, bool]:
    """Each run searched on an idle cluster (`window_bound`): (its bound, nodes, clock cut one)."""
    counts, nodes, cut = [], 0, False
    for run in runs:
        search = Segment(ref, jobs, run, node_budget, *shared[:2], stop_at=stop_at, beat=shared.beat)
        counts.append(search.solve()[0])
        nodes, cut = nodes + search.nodes, cut or search.timed_out
    return counts, nodes, cut
