"""Write-behind for the KV tiers: what the engine thread hands down, applied on a thread of its own.

The engine thread must not pay for a spill: when the device pool evicts a cached block, the only
work left on it is one copy of the block's bytes into a staging row (its device block is reused
right after); the put into the host arena (checksum, shared-memory copy, the arena's LRU and
its own spill to disk) and the cluster-index announcements (a Redis round trip each) run here.

    engine thread                      write-behind thread
    evict block b  --stage copy-->  [Spill(h_b, rows)] --> host.put, index.move(device -> host)
    publish hashes ------------->  [Announce(...)]    --> index.publish(device)

One FIFO keeps the index's view in the order the engine saw things (a block spilled and then
recomputed ends up held in both tiers, not only in the lower one). Staged rows are bounded
(`max_staged_blocks`): past it the engine thread waits for room (back-pressure, counted in
`stats.waits`) rather than dropping what it evicted. A failing op is logged and skipped: a
block not spilled is a cache miss later, never an error for a request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(slots=True)
class WriteBehindStats:
    applied: int = 0  # ops done
    failed: int = 0  # ops that raised (logged, skipped)
    waits: int = 0  # times the submitting thread waited for staging room


class WriteBehind:
    """A FIFO of ops (any objects) that one daemon thread passes to `apply` in batches, in order."""

    def __init__(self, apply: Callable[[list[object]], None], max_staged_blocks: int = 128,
                 name: str = "kv-write-behind") -> None:
        if max_staged_blocks < 1:
            raise ValueError(f"max_staged_blocks must be >= 1, got {max_staged_blocks}")
        self._apply, self.max_staged_blocks = apply, max_staged_blocks
        self._ops: deque[tuple[object, int]] = deque()
        self._cond = threading.Condition()
        self._staged = 0  # staged blocks queued or being applied
        self._busy = False  # the thread holds a batch
        self._closed = False
        self.stats = WriteBehindStats()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def on_thread(self) -> bool:
        """Whether the caller is the write-behind thread itself (its ops apply at once)."""
        return threading.current_thread() is self._thread

    def submit(self, op: object, staged_blocks: int = 0) -> None:
        """Queue `op`, which holds `staged_blocks` staging rows; waits while the rows queued
        would pass the bound (a single op larger than the bound waits for an empty queue)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("write-behind is closed")
            if staged_blocks and self._staged and self._staged + staged_blocks > self.max_staged_blocks:
                self.stats.waits += 1
                self._cond.wait_for(lambda: self._closed or not self._staged
                                    or self._staged + staged_blocks <= self.max_staged_blocks)
            self._ops.append((op, staged_blocks))
            self._staged += staged_blocks
            self._cond.notify_all()

    def pending(self) -> int:
        """Ops queued or being applied."""
        with self._cond:
            return len(self._ops) + self._busy

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every op submitted before the call is applied; False on timeout."""
        if self.on_thread():
            return False  # it would wait for itself
        with self._cond:
            return self._cond.wait_for(lambda: not self._ops and not self._busy, timeout=timeout_s)

    def close(self, timeout_s: float = 30.0) -> bool:
        """Apply what is queued, then stop the thread; False when it did not finish in time
        (the rest is dropped: blocks not spilled are only cache misses)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        done = not self._thread.is_alive()
        if not done:
            log.warning("write-behind: %d ops not applied within %.0f s of close", self.pending(), timeout_s)
        return done

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._ops or self._closed)
                if not self._ops:
                    return  # closed and drained
                batch = list(self._ops)
                self._ops.clear()
                self._busy = True
            start = time.perf_counter()
            try:
                self._apply([op for op, _ in batch])
                self.stats.applied += len(batch)
            except Exception:
                self.stats.failed += len(batch)
                log.exception("write-behind: %d ops failed after %.1f ms; skipped", len(batch),
                              1e3 * (time.perf_counter() - start))
            with self._cond:
                self._staged -= sum(n for _, n in batch)
                self._busy = False
                self._cond.notify_all()
