"""TCP backend: plain sockets; `sendmsg` gathers a frame's views and `recv_into` fills the
destination views directly (no intermediate copy in Python)."""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Sequence

from halfmoon.transport.channel import Backend, Channel, Listener
from halfmoon.transport.errors import PeerLostError, TransferTimeoutError

# sendmsg takes at most IOV_MAX (1024 on Linux) buffers per call.
_IOV_MAX = 1024
_SOCKET_BUFFER = 8 << 20
_POLL = 0.2  # seconds between checks for close() while waiting


class TcpChannel(Channel):
    """A non-blocking socket: waits happen in `select` in short slices, so a sender thread and
    a reader thread can share the socket with their own timeouts, and `close()` is noticed."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)
        sock.setblocking(False)
        self.sock = sock
        host, port = sock.getpeername()[:2]
        self.peer = f"{host}:{port}"
        self._closed = threading.Event()

    def sendv(self, views: Sequence[memoryview], timeout: float) -> None:
        pending = [v for v in views if v.nbytes]
        while pending:
            try:
                sent = self.sock.sendmsg(pending[:_IOV_MAX])
            except BlockingIOError:
                self._wait(write=True, timeout=timeout)
                continue
            except OSError as e:
                raise PeerLostError(f"send to {self.peer} failed: {e}") from e
            pending = _advance(pending, sent)

    def recv_into(self, views: Sequence[memoryview], timeout: float | None) -> None:
        pending = [v for v in views if v.nbytes]
        while pending:
            try:
                n = self.sock.recvmsg_into(pending[:_IOV_MAX])[0]
            except BlockingIOError:
                self._wait(write=False, timeout=timeout)
                continue
            except OSError as e:
                raise PeerLostError(f"receive from {self.peer} failed: {e}") from e
            if n == 0:
                raise PeerLostError(f"{self.peer} closed the connection")
            pending = _advance(pending, n)

    def _wait(self, write: bool, timeout: float | None) -> None:
        """Until the socket is ready; raises on close or when `timeout` passes with no progress."""
        waited = 0.0
        while not self._closed.is_set():
            try:
                r, w, _ = select.select([] if write else [self.sock], [self.sock] if write else [], [], _POLL)
            except (OSError, ValueError):  # closed under us by another thread
                break
            if r or w:
                return
            waited += _POLL
            if timeout is not None and waited >= timeout:
                what = "send to" if write else "receive from"
                raise TransferTimeoutError(f"{what} {self.peer} made no progress for {timeout:.1f}s")
        raise PeerLostError(f"channel to {self.peer} was closed")

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already reset by the peer
        self.sock.close()


def _advance(views: list[memoryview], sent: int) -> list[memoryview]:
    """Drop `sent` bytes from the front of `views`."""
    i = 0
    while i < len(views) and sent >= views[i].nbytes:
        sent -= views[i].nbytes
        i += 1
    rest = views[i:]
    if sent:
        rest[0] = rest[0][sent:]
    return rest


class TcpListener(Listener):
    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_server((host, port), reuse_port=False)
        bound_host, bound_port = self.sock.getsockname()[:2]
        self.address = f"tcp://{bound_host}:{bound_port}"
        self._closed = threading.Event()

    def accept(self, timeout: float | None) -> Channel | None:
        waited = 0.0
        while not self._closed.is_set():
            try:
                ready, _, _ = select.select([self.sock], [], [], 0.2)
                if ready:
                    conn, _ = self.sock.accept()
                    return TcpChannel(conn)
            except (OSError, ValueError):  # closed by another thread
                return None
            waited += 0.2
            if timeout is not None and waited >= timeout:
                return None
        return None

    def close(self) -> None:
        self._closed.set()
        self.sock.close()


class TcpBackend(Backend):
    name = "tcp"

    def listen(self, host: str, port: int) -> Listener:
        return TcpListener(host, port)

    def connect(self, address: str, timeout: float) -> Channel:
        host, port = parse_address(address, "tcp")
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except TimeoutError as e:
            raise TransferTimeoutError(f"connect to {address} timed out after {timeout:.1f}s") from e
        except OSError as e:
            raise PeerLostError(f"cannot connect to {address}: {e}") from e
        return TcpChannel(sock)


def parse_address(address: str, scheme: str) -> tuple[str, int]:
    """"tcp://host:port" (or "host:port") -> (host, port)."""
    rest = address.removeprefix(f"{scheme}://")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} is not {scheme}://host:port")
    return host.strip("[]"), int(port)
