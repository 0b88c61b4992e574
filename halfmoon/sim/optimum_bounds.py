"""The prefill side's upper bound of sim/optimum.py's search (`rest_bound`): how many of a
segment's requests from some position on could still be served, from their prefills alone.

Every node of the search prices it for each child, so it is written for speed: the requests'
arrivals, prefills and deadlines kept as arrays per segment (`Timeline`), the count of those
that fit alone taken at once, and the one-worker program (`one_worker`) skipping the counts
whose worker is free before the request arrives (it would end them no earlier). The figures
are the same floats the plain definitions give (tests/sim/test_optimum.py checks them).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from halfmoon.sim.optimum import Job

BOUND_HORIZON = 32  # `rest_bound` programs this many requests ahead and counts the rest one by one


class Timeline:
    """A segment's requests (`indexes`, in order) as arrays: arrival, best prefill, deadline."""

    def __init__(self, jobs: Sequence[Job], indexes: Sequence[int], deadlines: Sequence[float]) -> None:
        self.arrival = np.array([jobs[i].arrival_ms for i in indexes], dtype=np.float64)
        self.prefill = np.array([jobs[i].prefill_ms for i in indexes], dtype=np.float64)
        self.deadline = np.array(deadlines, dtype=np.float64)

    def fits(self, k: int, free: float) -> np.ndarray:
        """Per request from position `k` on: does its prefill alone, on a worker free at `free`,
        end by its deadline."""
        return np.maximum(self.arrival[k:], free) + self.prefill[k:] <= self.deadline[k:]


def rest_bound(jobs: Sequence[Job], indexes: Sequence[int], deadlines: Sequence[float],
               free: tuple[float, ...], horizon: int = BOUND_HORIZON, fits: np.ndarray | None = None) -> int:
    """An upper bound of how many of `indexes` can still be served, from the prefill side alone
    (decode and the first step at their lone cost): per worker, the most that one worker could
    finish by their deadlines in FCFS order (a dynamic program, exact for one worker: the
    earliest finish for each count served dominates; over the next `horizon` requests,
    those after counted when each fits alone), summed over the workers, and never more than
    those that fit one at a time on the first free worker. `fits`: `Timeline.fits` of them at
    min(free), when the caller keeps their timeline."""
    if fits is None:
        fits = Timeline(jobs, indexes, deadlines).fits(0, min(free))
    alone = int(np.count_nonzero(fits))
    total = int(np.count_nonzero(fits[horizon:]))
    near, ends = indexes[:horizon], deadlines[:horizon]
    for start in sorted(set(free)):
        total += one_worker(jobs, near, ends, start) * free.count(start)
        if total >= alone:
            return alone
    return total


def one_worker(jobs: Sequence[Job], indexes: Sequence[int], deadlines: Sequence[float], free: float) -> int:
    """The most of `indexes` one worker, free at `free`, finishes by their deadlines in FCFS order.

    finish[c], the earliest the worker is free having served c of them, never falls as c grows,
    so the counts whose worker is free by a request's arrival form a prefix, and serving it
    after them ends at arrival + prefill, never earlier than the next count's finish there."""
    if len(indexes) > BOUND_HORIZON:
        return one_worker_np(jobs, indexes, deadlines, free)
    finish = [free]
    for i, d in zip(indexes, deadlines, strict=True):
        job = jobs[i]
        a, p, top = job.arrival_ms, job.prefill_ms, len(finish) - 1
        for c in range(top, max(0, bisect_right(finish, a) - 1) - 1, -1):
            f = finish[c]
            end = (f if f >= a else a) + p  # noqa: FURB136  # max(f, a) + p without the call
            if end <= d:
                if c == top:
                    finish.append(end)
                elif end < finish[c + 1]:
                    finish[c + 1] = end
    return len(finish) - 1


def one_worker_np(jobs: Sequence[Job], indexes: Sequence[int], deadlines: Sequence[float], free: float) -> int:
    """`one_worker`'s program a request at a time over all counts at once (the same floats: each
    count's update reads the finish before this request, as the loop downwards does)."""
    finish = np.array([free])
    for i, d in zip(indexes, deadlines, strict=True):
        job = jobs[i]
        end = np.maximum(finish, job.arrival_ms) + job.prefill_ms
        ok = end <= d
        better = ok[:-1] & (end[:-1] < finish[1:])
        finish[1:] = np.where(better, end[:-1], finish[1:])
        if ok[-1]:
            finish = np.append(finish, end[-1])
    return len(finish) - 1
