"""Turns: work that awaits something on its way keeps the order it started in.

A prefill crosses two such ways, and a burst's prompts must reach the engine in the order
admission decided them (shortest predicted prefill first: conductor/admission_window.py):

- the Conductor reserves each request's KV on the decode worker before sending its prefill
  (conductor/cluster.py, step 3): RPCs answered in any order;
- the prefill worker opens each request's KV stream to the decode worker (a thread) before
  handing it to the engine (prefill_worker/worker.py).

Unordered, an idle engine started whichever came first: in a live run a 112-token prompt
predicted at 254 ms measured 581 ms behind a 135-token one, and the online calibration learned
a 1.95x guard from the mix-up and refused most of the next three bursts (issue 38).

`Turns` hands out turns in the caller's order (`take`, synchronous, before the await) and holds
each until every earlier turn is done or given up (`wait`, then `done` in a `finally`). A turn
waits at most `max_wait_s`: an earlier one stuck on a slow peer costs the later ones their
order, not their SLO.
"""

from __future__ import annotations

import asyncio
import contextlib


class Turns:
    """Turns in the order taken (module docstring)."""

    def __init__(self, max_wait_s: float = 0.5) -> None:
        self.max_wait_s = max_wait_s
        self._issued = 0
        self._head = 0  # the lowest turn not done
        self._done: set[int] = set()
        self._waiting: dict[int, asyncio.Event] = {}

    def take(self) -> int:
        """The next turn, in the caller's (decision) order."""
        turn, self._issued = self._issued, self._issued + 1
        return turn

    async def wait(self, turn: int) -> None:
        """Until every earlier turn is done, or `max_wait_s` passed."""
        if turn <= self._head:
            return
        event = self._waiting.setdefault(turn, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), self.max_wait_s)

    def done(self, turn: int) -> None:
        """`turn` sent (or given up): the next waiting turn may go. Idempotent."""
        if turn < self._head:
            return
        self._done.add(turn)
        while self._head in self._done:
            self._done.discard(self._head)
            self._waiting.pop(self._head, None)
            self._head += 1
        event = self._waiting.pop(self._head, None)
        if event is not None:
            event.set()

    @property
    def outstanding(self) -> int:
        """Turns taken and not done (0 when idle: the invariant the tests hold)."""
        return self._issued - self._head - len(self._done)
