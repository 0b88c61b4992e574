"""The one bounded wait of the test suite: poll an observable condition until it holds.

Tests wait on something they can see (a worker's load, a metric, a log line, a health status),
never on a bare sleep; the only sleep here is the poll interval, and every wait has a deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_INTERVAL_S = 0.05


def poll(predicate: Callable[[], T], timeout_s: float, interval_s: float = POLL_INTERVAL_S) -> T:
    """`predicate()`'s first truthy result within `timeout_s`, else its last (falsy) result.

    The predicate is called at least once, and once more at the deadline.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result or time.monotonic() >= deadline:
            return result
        time.sleep(interval_s)  # the poll interval of this bounded wait


def wait_until(predicate: Callable[[], T], timeout_s: float = 30.0, what: str = "the condition",
               interval_s: float = POLL_INTERVAL_S) -> T:
    """`predicate()`'s first truthy result; AssertionError naming `what` after `timeout_s`."""
    result = poll(predicate, timeout_s, interval_s)
    assert result, f"timed out after {timeout_s:g} s waiting for {what}"
    return result
