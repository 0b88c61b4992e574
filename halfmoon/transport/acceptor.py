"""The server side's connection handling, shared by the KV receiver and the block server:
accept channels on a listener and serve each on a thread of its own; close() stops accepting
and closes every open channel (a blocked receive on it wakes with PeerLostError)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from halfmoon.transport.channel import Channel, Listener

log = logging.getLogger("halfmoon.transport")


class Acceptor:
    """`serve(channel)` runs on a thread per accepted channel; the channel is closed and
    forgotten when it returns or raises (an exception it did not handle is logged with its
    traceback, and only that channel is lost)."""

    def __init__(self, listener: Listener, serve: Callable[[Channel], None], name: str) -> None:
        self._listener, self._serve, self._name = listener, serve, name
        self.address = listener.address
        self._channels: set[Channel] = set()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> Acceptor:
        self._spawn(self._accept_loop, f"{self._name}-accept")
        return self

    @property
    def open_channels(self) -> int:
        with self._lock:
            return len(self._channels)

    def close(self, join_s: float = 0.0) -> None:
        """Stop accepting, close every channel; then wait up to `join_s` for each thread."""
        with self._lock:
            self._closed = True
            channels = list(self._channels)
            threads = list(self._threads)
        self._listener.close()
        for channel in channels:
            channel.close()
        if join_s > 0:
            for t in threads:
                t.join(timeout=join_s)

    def _accept_loop(self) -> None:
        while (channel := self._listener.accept(timeout=None)) is not None:
            with self._lock:
                if self._closed:
                    channel.close()
                    return
                self._channels.add(channel)
            self._spawn(lambda ch=channel: self._run(ch), f"{self._name}-{channel.peer}")

    def _run(self, channel: Channel) -> None:
        try:
            self._serve(channel)
        except Exception:
            log.exception("%s: serving %s failed", self._name, channel.peer)
        finally:
            channel.close()
            with self._lock:
                self._channels.discard(channel)

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)
        t.start()
