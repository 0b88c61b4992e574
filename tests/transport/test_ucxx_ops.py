"""The ucxx runtime's operation handle (no UCX needed): finished once by the owner thread,
then finished for every waiter, however many wait at once."""

from __future__ import annotations

import threading
import time

from halfmoon.transport.ucxx_runtime import Op


def test_an_operation_waits_until_finished_then_stays_finished() -> None:
    op = Op()
    assert not op.wait(0) and not op.wait(0.01)
    threading.Timer(0.05, op.finish).start()
    start = time.monotonic()
    assert op.wait(5.0) and time.monotonic() - start < 2.0
    assert op.wait(0) and op.wait(None)


def test_a_finished_operation_is_finished_for_concurrent_waiters() -> None:
    """A zero-timeout check while other threads are inside their own waits (the lock is briefly
    held by each of them) still sees the operation finished."""
    op = Op()
    op.finish()
    stop = threading.Event()
    misses: list[int] = []

    def hammer() -> None:
        while not stop.is_set():
            if not op.wait(1.0):
                misses.append(1)

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        checks = [op.wait(0) for _ in range(50_000)]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert all(checks) and not misses
