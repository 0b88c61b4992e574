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

Second looks (`AdmissionConfig.second_look`): a request the window would refuse only for its
predicted TTFT, that would still meet it on idle workers, is kept instead (`SecondLook`: the
decision raised it, with the time left to start its prefill). Each time a prefill ends (`relook`,
called by the Conductor and the simulator) the kept requests are decided again in the window's
order, on ledgers where what ran ahead of them is measured, not predicted; at the end of its
time a request is decided a last time and refused if it still does not fit. A look that is not
the last admits only with a margin (`SECOND_LOOK_MARGIN`, conductor/admission.py): a request near
its objective waits until more of the queue ahead is measured, instead of being admitted on a
prediction that a slower minute turns into a miss. Why: a burst is
decided on predictions guarded at the p90 of past errors, and every admitted prefill that ends
sooner than its guard frees room the first decision could not count on (issue 38: live, the
requests refused at the guard's margin were those the offline optimum served).

The window owns no clock: `schedule(delay_s, fn)` runs `fn` later on the caller's (the
Conductor's event loop, the simulator's event queue), so both run this code.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

Schedule = Callable[[float, Callable[[], None]], Any]
# Decides a held request: `final` False may raise SecondLook (kept for a later look); True decides for good.
Decide = Callable[[bool], None]


class SecondLook(Exception):  # noqa: N818 - control flow between the decision and the window, never an error
    """The decision is deferred: the request may be admitted within `within_s` (module docstring)."""

    def __init__(self, within_s: float) -> None:
        super().__init__(f"a second look within {within_s:.3f} s")
        self.within_s = within_s


class Held(NamedTuple):
    key: tuple[int, float]  # (-rank, predicted prefill ms): decided in this order
    seq: int  # arrival order among equal keys
    decide: Decide


class AdmissionWindow:
    """Arrivals held `window_ms`, then decided in `Held.key` order (module docstring)."""

    def __init__(self, window_ms: float, schedule: Schedule) -> None:
        if not window_ms >= 0:
            raise ValueError(f"window_ms must be >= 0, got {window_ms}")
        self.window_ms = window_ms
        self._schedule = schedule
        self._held: list[Held] = []
        self._kept: dict[int, Held] = {}  # second looks pending, by seq
        self._seq = itertools.count()

    @property
    def held(self) -> int:
        """Requests waiting for a decision: in the window or kept for a second look."""
        return len(self._held) + len(self._kept)

    def hold(self, rank: int, prefill_ms: float, decide: Decide) -> None:
        """Decide later (now, for good, when the window is 0): `decide` books or refuses it."""
        if self.window_ms <= 0:
            decide(True)
            return
        self._held.append(Held((-rank, prefill_ms), next(self._seq), decide))
        if len(self._held) == 1:
            self._schedule(self.window_ms / 1e3, self.flush)

    def flush(self) -> None:
        """Decide every held request, highest rank and shortest predicted prefill first."""
        held, self._held = self._held, []
        self._look(held, first=True)

    def relook(self) -> None:
        """A prefill ended: decide the kept requests again, in the window's order."""
        if self._kept:
            kept, self._kept = list(self._kept.values()), {}
            self._look(kept, first=False)

    def _look(self, held: list[Held], first: bool) -> None:
        for h in sorted(held, key=lambda h: (h.key, h.seq)):
            try:
                h.decide(False)
            except SecondLook as e:
                self._kept[h.seq] = h
                if first:  # its last look, once: when its time to start runs out
                    self._schedule(e.within_s, lambda seq=h.seq: self._last(seq))

    def _last(self, seq: int) -> None:
        h = self._kept.pop(seq, None)
        if h is not None:
            h.decide(True)
