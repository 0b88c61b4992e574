"""Local backend: both ends in one process (unit tests, the co-located mode).

A frame is handed over by reference and copied once, straight from the sender's views into the
receiver's (the same single copy a socket makes); `sendv` returns when the receiver has copied
it, so the sender may reuse its buffers, as with every other backend.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence

from halfmoon.transport.channel import Backend, Channel, Listener
from halfmoon.transport.errors import PeerLostError, ProtocolError, TransferTimeoutError
from halfmoon.transport.frames import copy_views, total_bytes


class _Pipe:
    """One direction: frames waiting to be copied out, each with a done event."""

    def __init__(self) -> None:
        self.frames: deque[tuple[Sequence[memoryview], threading.Event]] = deque()
        self.cond = threading.Condition()
        self.closed = False


class LocalChannel(Channel):
    message_based = True

    def __init__(self, outgoing: _Pipe, incoming: _Pipe, peer: str) -> None:
        self._out = outgoing
        self._in = incoming
        self.peer = peer

    def sendv(self, views: Sequence[memoryview], timeout: float) -> None:
        done = threading.Event()
        with self._out.cond:
            if self._out.closed:
                raise PeerLostError(f"channel to {self.peer} is closed")
            self._out.frames.append((views, done))
            self._out.cond.notify_all()
        deadline = time.monotonic() + timeout
        while not done.wait(0.05):
            with self._out.cond:
                if self._out.closed:
                    raise PeerLostError(f"{self.peer} closed the channel before receiving a frame")
            if time.monotonic() > deadline:
                raise TransferTimeoutError(f"{self.peer} did not receive a frame within {timeout:.1f}s")

    def recv_into(self, views: Sequence[memoryview], timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._in.cond:
            while not self._in.frames:
                if self._in.closed:
                    raise PeerLostError(f"{self.peer} closed the channel")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransferTimeoutError(f"no frame from {self.peer} within {timeout:.1f}s")
                self._in.cond.wait(0.05 if left is None else min(left, 0.05))
            src, done = self._in.frames.popleft()
        copy_views(src, _prefix(views, total_bytes(src)))
        done.set()

    def close(self) -> None:
        for pipe in (self._out, self._in):
            with pipe.cond:
                pipe.closed = True
                pipe.cond.notify_all()


def _prefix(views: Sequence[memoryview], nbytes: int) -> list[memoryview]:
    """The first `nbytes` of `views` (a message smaller than the receive buffers fills a prefix)."""
    out = []
    for v in views:
        if nbytes <= 0:
            break
        out.append(v[:nbytes])
        nbytes -= out[-1].nbytes
    if nbytes > 0:
        raise ProtocolError(f"a message {nbytes} bytes larger than the receive buffers")
    return out


class LocalListener(Listener):
    def __init__(self, backend: LocalBackend, address: str) -> None:
        self.address = address
        self._backend = backend
        self._pending: deque[LocalChannel] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def offer(self, channel: LocalChannel) -> None:
        with self._cond:
            if self._closed:
                raise PeerLostError(f"{self.address} is closed")
            self._pending.append(channel)
            self._cond.notify_all()

    def accept(self, timeout: float | None) -> Channel | None:
        with self._cond:
            self._cond.wait_for(lambda: self._pending or self._closed, timeout)
            return self._pending.popleft() if self._pending else None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._backend.forget(self.address)


class LocalBackend(Backend):
    """Addresses are "local://N" and live in this backend object: sender and receiver must share it."""

    name = "local"

    def __init__(self) -> None:
        self._listeners: dict[str, LocalListener] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def listen(self, host: str, port: int) -> Listener:
        with self._lock:
            address = f"local://{next(self._ids)}"
            listener = self._listeners[address] = LocalListener(self, address)
        return listener

    def connect(self, address: str, timeout: float) -> Channel:
        with self._lock:
            listener = self._listeners.get(address)
        if listener is None:
            raise PeerLostError(f"nothing listens on {address}")
        a_to_b, b_to_a = _Pipe(), _Pipe()
        listener.offer(LocalChannel(b_to_a, a_to_b, "local-sender"))
        return LocalChannel(a_to_b, b_to_a, address)

    def forget(self, address: str) -> None:
        with self._lock:
            self._listeners.pop(address, None)
