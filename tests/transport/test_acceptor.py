"""halfmoon.transport.acceptor: one thread per accepted channel, channels closed when served or on close(),
a failing handler costs only its own channel. On every backend (the KV receiver and the block
server are built on it; their suites run through it too)."""

from __future__ import annotations

import threading

import pytest

from tests.waiting import poll
from halfmoon.transport.acceptor import Acceptor
from halfmoon.transport.channel import Backend, Channel
from halfmoon.transport.errors import PeerLostError


def _echo(channel: Channel) -> None:
    """Echo 8-byte frames until the peer goes; b'boom....' raises instead."""
    while True:
        buf = bytearray(8)
        channel.recv_into([memoryview(buf)], None)
        if bytes(buf) == b"boom....":
            raise RuntimeError("handler failed")
        channel.sendv([memoryview(buf)], 5.0)


def _ask(channel: Channel, msg: bytes) -> bytes:
    channel.sendv([memoryview(msg)], 5.0)
    buf = bytearray(8)
    channel.recv_into([memoryview(buf)], 5.0)
    return bytes(buf)


def test_channels_are_served_at_once_and_closed_with_the_acceptor(backend: Backend) -> None:
    acceptor = Acceptor(backend.listen("127.0.0.1", 0), _echo, "test").start()
    clients = [backend.connect(acceptor.address, 5.0) for _ in range(3)]
    try:
        # All three are served concurrently: each answers while the others stay open.
        assert [_ask(c, f"hello-{i}.".encode()) for i, c in enumerate(clients)] == \
            [b"hello-0.", b"hello-1.", b"hello-2."]
        assert acceptor.open_channels == 3
        acceptor.close(join_s=5.0)
        assert acceptor.open_channels == 0
        for c in clients:  # the server's ends are closed: the clients see the peer go
            with pytest.raises(PeerLostError):
                _ask(c, b"anyone?.")
    finally:
        for c in clients:
            c.close()


def test_a_failing_handler_costs_only_its_channel(backend: Backend, caplog: pytest.LogCaptureFixture) -> None:
    acceptor = Acceptor(backend.listen("127.0.0.1", 0), _echo, "test").start()
    good, bad = backend.connect(acceptor.address, 5.0), backend.connect(acceptor.address, 5.0)
    try:
        assert _ask(good, b"first...") == b"first..."
        bad.sendv([memoryview(b"boom....")], 5.0)
        assert poll(lambda: "handler failed" in caplog.text, 5.0), "the failure was not logged"
        assert "serving" in caplog.text  # loudly, with the cause
        assert poll(lambda: acceptor.open_channels == 1, 5.0), "the failed channel was not closed"
        assert _ask(good, b"still...") == b"still..."
        late = backend.connect(acceptor.address, 5.0)  # and accepting goes on
        assert _ask(late, b"late....") == b"late...."
        late.close()
    finally:
        good.close()
        bad.close()
        acceptor.close(join_s=5.0)


def test_close_stops_the_accept_thread(backend: Backend) -> None:
    acceptor = Acceptor(backend.listen("127.0.0.1", 0), _echo, "test-close").start()
    acceptor.close(join_s=5.0)
    assert poll(lambda: not any(t.name == "test-close-accept" for t in threading.enumerate()), 5.0)
