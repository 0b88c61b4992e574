"""Helpers the transport tests share (not tests, not fixtures: those are in conftest.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from bench.transport_bench import Peer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POLL_S = 0.02  # how often `eventually` looks again


def eventually(cond: Callable[[], object], timeout: float = 5.0) -> bool:
    """True as soon as `cond()` is true; False if it is still false after `timeout` seconds.
    For a condition no event announces (a counter another thread bumps, a thread that ends)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return bool(cond())
        time.sleep(POLL_S)  # the poll interval, not a synchronisation: the loop re-checks `cond`
    return True


def peer_process(*args: str) -> Peer:
    """`tests.transport.peer` in its own process (see its docstring for `args` and ops)."""
    return Peer(args, module="tests.transport.peer", cwd=REPO)
