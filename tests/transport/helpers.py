"""Helpers the transport tests share (not tests, not fixtures: those are in conftest.py; the
bounded wait is tests.waiting)."""

from __future__ import annotations

import os

from bench.transport_bench import Peer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def peer_process(*args: str) -> Peer:
    """`tests.transport.peer` in its own process (see its docstring for `args` and ops)."""
    return Peer(args, module="tests.transport.peer", cwd=REPO)
