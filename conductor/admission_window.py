"""The admission window: arrivals held for a few ms, then decided shortest prefill first.

A burst arrives within milliseconds. Deciding each request the moment it arrives (first come,
first served) admits the burst's first requests while they fit and refuses the rest, long or
short; the most a cluster can serve of a burst within the TTFT objective is its *short*
prompts (sim/optimum.py finds that schedule: bursty seed 0, 20 served against FCFS's 10).
The window holds every arrival for `admit_window_ms` from the first one held, then decides
the held requests in order of (priority rank, predicted prefill ms): each decision is the
ordinary one (conductor/dispatch.py) on the ledgers as the ones before it left them, and the
prefill queue serves equal deadlines in admission order (`PendingPrefill.seq`), so the short
prompts are admitted and served first. A request's held time counts against its TTFT
(`Candidate.held_ms`). With `admit_window_ms` 0 each request is decided as it arrives.

The window owns no clock: `schedule(delay_s, fn)` runs `fn` later on the caller's (the
Conductor's event loop, the simulator's event queue), so both run this code.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

Schedule = Callable[[float, Callable[[], None]], Any]


class Held(NamedTuple):
    key: tuple[int, float]  # (-rank, predicted prefill ms): decided in this order
    seq: int  # arrival order among equal keys
    decide: Callable[[], None]


class AdmissionWindow:
    """Arrivals held `window_ms`, then decided in `Held.key` order (module docstring)."""

    def __init__(self, window_ms: float, schedule: Schedule) -> None:
        if not window_ms >= 0:
            raise ValueError(f"window_ms must be >= 0, got {window_ms}")
        self.window_ms = window_ms
        self._schedule = schedule
        self._held: list[Held] = []
        self._seq = itertools.count()

    @property
    def held(self) -> int:
        return len(self._held)

    def hold(self, rank: int, prefill_ms: float, decide: Callable[[], None]) -> None:
        """Decide later (now when the window is 0): `decide` books or refuses the request."""
        if self.window_ms <= 0:
            decide()
            return
        self._held.append(Held((-rank, prefill_ms), next(self._seq), decide))
        if len(self._held) == 1:
            self._schedule(self.window_ms / 1e3, self.flush)

    def flush(self) -> None:
        """Decide every held request, highest rank and shortest predicted prefill first."""
        held, self._held = sorted(self._held, key=lambda h: (h.key, h.seq)), []
        for h in held:
            h.decide()
