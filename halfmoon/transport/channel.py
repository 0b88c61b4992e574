"""The one thing a backend provides: a reliable, ordered, bidirectional channel of frames.

A frame is what one `sendv` call sends; the receiver always knows its size in advance (headers
are fixed-size, the header says the rest) and passes views of exactly that many bytes to
`recv_into`, which fills them in order. Byte-stream backends (tcp) may ignore frame boundaries;
message backends (ucxx) send one message per frame.

Every wait takes a timeout (`None` = until the channel closes: only for a receiver idling
between messages). `close()` from another thread wakes a blocked `recv_into` with
`PeerLostError`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence


class Channel(abc.ABC):
    peer: str  # printable address of the other end
    # True when each sendv arrives as one message and `recv_into` views may be larger than it
    # (the message fills a prefix); False for byte streams, where sizes must match exactly.
    message_based: bool = False

    @abc.abstractmethod
    def sendv(self, views: Sequence[memoryview], timeout: float) -> None:
        """Send one frame (the concatenation of `views`); the views may be reused on return."""

    @abc.abstractmethod
    def recv_into(self, views: Sequence[memoryview], timeout: float | None) -> None:
        """Receive one frame into `views` (their total size is the frame's size)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close both directions; idempotent."""

    def recv_control(self, nbytes: int, timeout: float | None) -> memoryview:
        """Receive one frame of at most `nbytes` (a message backend: the message fills a prefix).
        The protocol reads every control message this way, always with the same `nbytes`, so
        a message backend may keep such receives posted ahead (ucxx does)."""
        buf = memoryview(bytearray(nbytes))
        self.recv_into([buf], timeout)
        return buf

    def send_many(self, frames: Sequence[Sequence[memoryview]], timeout: float,
                  before: Callable[[int], None] | None = None) -> None:
        """Send frames in order, calling `before(i)` right before frame i goes out (it may
        still fill that frame). Message backends keep several frames in flight."""
        for i, frame in enumerate(frames):
            if before is not None:
                before(i)
            self.sendv(frame, timeout)

    def post_many(self, frames: Sequence[Sequence[memoryview]], timeout: float,
                  before: Callable[[int], None] | None = None,
                  data_from: int | None = None) -> Callable[[float], None] | None:
        """Like `send_many`, but may return before the last frames completed: then it returns a
        function that waits for them (the views must stay untouched until it returned). Lets a
        sender start its next message while the previous one is still on the wire.

        `data_from`: frames from this index on are payload. A backend with `posted_recv` sends
        them on the channel's data lane, which the receiver matches with `post_recvs`; a byte
        stream ignores it (one lane, in order)."""
        self.send_many(frames, timeout, before)
        return None

    # Message backends that can post receives ahead (ucxx): the receiver posts a unit's payload
    # frames as soon as its header arrived, and reads the next header while they land.
    posted_recv: bool = False

    def post_recvs(self, frames: Sequence[Sequence[memoryview]]) -> PostedRecvs:
        """Post a receive for every frame on the data lane now, in order (payload frames sent
        with `post_many(..., data_from=...)`); the frames' memory is the channel's until waited."""
        raise NotImplementedError(f"{type(self).__name__} cannot post receives ahead")

    def recv_many(self, frames: Sequence[Sequence[memoryview]], timeout: float,
                  after: Callable[[int], None] | None = None) -> None:
        """Receive frames in order, calling `after(i)` once frame i has landed. Message
        backends post several receives ahead, so `after` overlaps the next frames' transfer."""
        for i, frame in enumerate(frames):
            self.recv_into(frame, timeout)
            if after is not None:
                after(i)


class PostedRecvs(abc.ABC):
    """Receives posted by `Channel.post_recvs`, waited for one by one, in order."""

    @abc.abstractmethod
    def wait(self, i: int, timeout: float | None) -> None:
        """Return once frame i has landed in its views (raises PeerLostError /
        TransferTimeoutError); frames must be waited for in order."""


class Listener(abc.ABC):
    address: str  # what a sender passes to `Backend.connect`

    @abc.abstractmethod
    def accept(self, timeout: float | None) -> Channel | None:
        """The next incoming channel, or None when the listener was closed (or timed out)."""

    @abc.abstractmethod
    def close(self) -> None: ...


class Backend(abc.ABC):
    name: str

    @abc.abstractmethod
    def listen(self, host: str, port: int) -> Listener: ...

    @abc.abstractmethod
    def connect(self, address: str, timeout: float) -> Channel: ...


BACKENDS = ("ucxx", "tcp", "local")


def get_backend(name: str, ucx_tls: str | None = None, ucx_poll_us: int | None = None) -> Backend:
    """The backend called `name`; "auto" is ucxx when it imports, else tcp — with a warning
    that says why. A backend asked for by name that cannot run raises
    `BackendUnavailableError` here, at startup: there is no silent fallback. `ucx_poll_us`:
    see `TransportConfig.ucx_poll_us` (None: the ucxx backend's default)."""
    from halfmoon.transport.errors import BackendUnavailableError

    if name == "auto":
        return _auto(ucx_tls, ucx_poll_us)
    if name == "tcp":
        from halfmoon.transport.tcp import TcpBackend

        return TcpBackend()
    if name == "local":
        from halfmoon.transport.local import LocalBackend

        return LocalBackend()
    if name == "ucxx":
        from halfmoon.transport.ucxx_backend import UcxxBackend

        return UcxxBackend(ucx_tls) if ucx_poll_us is None else UcxxBackend(ucx_tls, ucx_poll_us)
    raise BackendUnavailableError(name, f"unknown backend; choose one of {', '.join(BACKENDS)} or auto")


def _auto(ucx_tls: str | None, ucx_poll_us: int | None) -> Backend:
    import logging

    from halfmoon.transport.errors import BackendUnavailableError

    try:
        return get_backend("ucxx", ucx_tls, ucx_poll_us)
    except BackendUnavailableError as e:
        logging.getLogger("halfmoon.transport").warning(
            "KV transport: %s -- using the tcp backend (pass --kv-transport tcp to silence this, "
            "or install ucxx-cu12 for UCX)", e)
        return get_backend("tcp")
