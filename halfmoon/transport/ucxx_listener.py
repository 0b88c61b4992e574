"""The ucxx backend's listener: accepts UCX connections and greets each new peer.

A connecting peer sends its channel id over the endpoint's stream right after connecting
(transport.ucxx_channel.connect); the listener reads it on a short-lived thread per connection,
so a mute peer holds up nobody else, and hands the greeted channel to `accept`. When the worker
is replaced (transport.ucxx_runtime.replace_runtime), the listener moves to the new one on its
own port.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import numpy as np

from halfmoon.transport.channel import Channel, Listener
from halfmoon.transport.errors import TransportError
from halfmoon.transport.ucxx_channel import CloseWatch, UcxxChannel, close_held, watched
from halfmoon.transport.ucxx_runtime import UcxRuntime

log = logging.getLogger("halfmoon.transport")
# A connecting peer sends its channel id right after connecting; one that does not within this
# is dropped (each is greeted on a thread of its own, so a mute one holds up nobody else).
GREET_TIMEOUT_S = 5.0
MOVE_TIMEOUT_S = GREET_TIMEOUT_S + 5.0  # a moving listener waits this long for its port


class UcxxListener(Listener):
    """Accepts UCX connections. Each new endpoint is greeted (its channel id read) on a
    short-lived thread of its own, so a peer that stays mute holds up nobody else."""

    def __init__(self, rt: UcxRuntime, host: str, port: int, greet_timeout: float = GREET_TIMEOUT_S) -> None:
        self._ready: queue.Queue[UcxxChannel | None] = queue.Queue()
        self._greet_timeout = greet_timeout
        self._lock = threading.Lock()  # orders greeted channels against close()
        self._closed = False
        self._arrived = threading.Condition()  # notified on each incoming connection
        self._connections = 0  # incoming connections so far, greeted or not
        self._rt, self._held = rt, self._listen(rt, port)
        self.port = self._held[0].port
        self.address = f"ucxx://{host}:{self.port}"
        rt.adopt_listener(self)

    def _listen(self, rt: UcxRuntime, port: int) -> list[Any]:
        """A UCX listener on `rt`'s worker, in a list only the owner thread empties."""
        held: list[Any] = []

        def create() -> None:  # on the owner thread, before any connection can be delivered
            held.append(rt.ucx.UCXListener.create(rt.worker, port, lambda req: self._on_connect(rt, held, req)))

        rt.call(create, 30.0, "listen")
        return held

    def _on_connect(self, rt: UcxRuntime, held: list[Any], conn_request: Any) -> None:
        """Runs on the owner thread inside progress: make the endpoint, greet it elsewhere."""
        endpoint, watch = watched(rt, held[0].create_endpoint_from_conn_request(conn_request, True))
        threading.Thread(target=self._greet, args=(rt, [endpoint], watch), name="ucx-greet", daemon=True).start()
        with self._arrived:
            self._connections += 1
            self._arrived.notify_all()

    def wait_connections(self, n: int, timeout: float) -> bool:
        """True once `n` connections reached this listener (their endpoints made, greeted or
        not); False after `timeout` seconds. Lets a caller (a test) act on a peer that has
        connected but not yet introduced itself."""
        with self._arrived:
            return self._arrived.wait_for(lambda: self._connections >= n, timeout)

    def move_to(self, rt: UcxRuntime) -> None:
        """Listen on `rt`'s worker instead, on the same port (see replace_runtime)."""
        if self._closed:
            return
        self._rt.call(self._held.clear, 10.0, "close listener")  # destroyed on its owner thread
        deadline = time.monotonic() + MOVE_TIMEOUT_S
        while True:  # the port is bound until the endpoints accepted on it are gone too
            try:
                self._rt, self._held = rt, self._listen(rt, self.port)
                break
            except TransportError as e:
                if time.monotonic() > deadline:
                    log.error("the UCX listener %s could not move to the new worker: %s; it accepts "
                              "no more connections", self.address, e)
                    self.close()
                    return
                time.sleep(0.1)
        rt.adopt_listener(self)

    def accept(self, timeout: float | None) -> Channel | None:
        """The next peer that introduced itself; None on timeout or once closed. A connection
        that fails or stays mute before sending its channel id (a peer that died or gave up
        while connecting, e.g. a stale attempt at an address this listener now reuses) is
        dropped with a warning and never returned."""
        try:
            channel = self._ready.get(timeout=timeout)
        except queue.Empty:
            return None
        if channel is None:
            self._ready.put(None)  # closed: wake every other waiting accept() too
        return channel

    def _greet(self, rt: UcxRuntime, holder: list[Any], watch: CloseWatch) -> None:
        """On a greeting thread: read the channel id, then hand the channel to accept()."""
        try:
            channel = self._introduce(rt, holder, watch)
        except TransportError as e:
            log.warning("dropped an incoming UCX connection on %s: %s", self.address, e)
            rt.post(lambda: close_held(holder, watch), is_request=False)
            return
        with self._lock:
            if not self._closed and not rt.retired:
                self._ready.put(channel)
                return
        channel.close()  # greeted after the listener closed or its worker was replaced

    def _introduce(self, rt: UcxRuntime, holder: list[Any], watch: CloseWatch) -> UcxxChannel:
        """The connecting side's first bytes on the endpoint's stream: its channel id."""
        hello = np.zeros(1, np.uint64)
        array = rt.Array(hello)
        rt.wait(rt.post(lambda: holder[0].stream_recv(array)), self._greet_timeout, "channel id from a new peer")
        channel_id = int(hello[0])
        return UcxxChannel(rt, holder.pop(), watch, channel_id, outbound=False, peer=f"ucxx-peer-{channel_id:x}")

    def close(self) -> None:
        """Stop accepting: waiting accept() calls return None; channels greeted but not
        accepted are closed."""
        with self._lock:
            self._closed = True
            unclaimed = []
            while not self._ready.empty():
                unclaimed.append(self._ready.get_nowait())
            self._ready.put(None)
        for channel in unclaimed:
            if channel is not None:
                channel.close()
        self._rt.post(self._held.clear, is_request=False)  # destroyed on the owner thread

