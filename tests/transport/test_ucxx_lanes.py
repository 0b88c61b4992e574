"""The ucxx channel's two lanes: payload receives posted ahead (data lane) never swallow a
control message, and the receiver reads headers while payload is still landing.

This is what lets `KVReceiver` post the next unit's payload before it has hashed the previous
one (transport.receiver._Pipeline); the shared suite (test_backends, test_faults) runs the
whole protocol over it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from tests.transport.conftest import accept_pair
from halfmoon.transport import get_backend
from halfmoon.transport.channel import Channel
from halfmoon.transport.errors import TransferTimeoutError


@pytest.fixture
def pair() -> Iterator[tuple[Channel, Channel]]:
    backend = get_backend("ucxx")
    listener = backend.listen("127.0.0.1", 0)
    sender, receiver = accept_pair(backend, listener)
    yield sender, receiver
    sender.close()
    receiver.close()
    listener.close()


def test_control_messages_pass_payload_receives_posted_ahead(pair: tuple[Channel, Channel]) -> None:
    sender, receiver = pair
    assert receiver.posted_recv and receiver.message_based
    rng = np.random.default_rng(0)
    payload = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1 << 20, 3000, 64)]
    # Receiver: payload frames posted first (data lane), one of them into a 3-view frame.
    out = [np.zeros_like(p) for p in payload]
    split = [memoryview(out[1])[:1000], memoryview(out[1])[1000:2000], memoryview(out[1])[2000:]]
    posted = receiver.post_recvs([[memoryview(out[0])], split, [memoryview(out[2])]])
    # Sender: control, payload (data lane from index 1), control again.
    frames = [[memoryview(b"head-1")], *[[memoryview(p)] for p in payload], [memoryview(b"head-2")]]
    finish = sender.post_many(frames[:4], 10.0, data_from=1)
    sender.send_many([frames[4]], 10.0)
    # Both control messages arrive on the control lane, whatever the data lane holds.
    got = [bytearray(16), bytearray(16)]
    for buf in got:
        receiver.recv_into([memoryview(buf)], 10.0)
    assert [bytes(g[:6]) for g in got] == [b"head-1", b"head-2"]
    for i in range(3):
        posted.wait(i, 10.0)
    finish(10.0)
    for p, o in zip(payload, out):
        assert np.array_equal(p, o)


def test_control_receives_stay_posted_and_the_lane_has_one_reader(pair: tuple[Channel, Channel]) -> None:
    """recv_control keeps receives posted on the control lane, so messages already sent are
    read at once, in order; a timed-out read leaves them in step; a raw receive on that lane
    afterwards is refused (it would take a message meant for a posted control receive)."""
    from halfmoon.transport.protocol import CONTROL_BYTES, Header, Kind, recv_msg, send_msg

    sender, receiver = pair
    with pytest.raises(TransferTimeoutError):
        recv_msg(receiver, 0.3, 1.0)  # nothing sent yet: the posted receives stay posted
    for i in range(6):  # more than are posted ahead
        send_msg(sender, Header(Kind.DONE, count=i), b"x" * i, 5.0)
    assert [recv_msg(receiver, 5.0, 5.0) for _ in range(6)] == [
        (Header(Kind.DONE, body_len=i, count=i), b"x" * i) for i in range(6)]
    with pytest.raises(RuntimeError, match="control lane"):
        receiver.recv_into([memoryview(bytearray(CONTROL_BYTES))], 1.0)


def test_closing_fails_posted_receives_and_returns_once_nothing_writes(
        pair: tuple[Channel, Channel]) -> None:
    from halfmoon.transport.errors import PeerLostError

    _, receiver = pair
    buf = np.zeros(1 << 16, np.uint8)
    posted = receiver.post_recvs([[memoryview(buf)]])
    closer = threading.Timer(0.3, receiver.close)
    closer.start()
    with pytest.raises(PeerLostError):
        posted.wait(0, 10.0)
    closer.join()


def test_a_peer_that_never_introduces_itself_is_dropped_and_accepting_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    """A connection that dies before sending its channel id (seen in CI: a stale attempt at a
    port a new listener reused) must not end the accept loop of a KV receiver."""
    from halfmoon.transport.tcp import parse_address
    from halfmoon.transport.ucxx_channel import close_held
    from halfmoon.transport.ucxx_runtime import current_runtime

    backend = get_backend("ucxx")
    listener = backend.listen("127.0.0.1", 0)
    rt = current_runtime()
    host, port = parse_address(listener.address, "ucxx")
    mute = [rt.call(lambda: rt.ucx.UCXEndpoint.create(rt.worker, host, port, True), 10.0, "connect")]
    assert listener.wait_connections(1, 10.0), "the listener never saw the mute connection"
    rt.call(lambda: close_held(mute), 10.0, "close")  # gone without a word
    accepted: list[Channel | None] = []
    t = threading.Thread(target=lambda: accepted.append(listener.accept(20.0)))
    t.start()
    sender = backend.connect(listener.address, 10.0)
    t.join(30.0)
    try:
        assert accepted and accepted[0] is not None, "accept gave up after the mute peer"
        receiver = accepted[0]
        sender.sendv([memoryview(b"hello")], 10.0)
        buf = bytearray(16)
        receiver.recv_into([memoryview(buf)], 10.0)
        assert bytes(buf[:5]) == b"hello"
        receiver.close()
        assert "dropped an incoming UCX connection" in caplog.text  # the mute peer was seen
    finally:
        sender.close()
        listener.close()



def test_a_mute_peer_does_not_hold_up_the_next_connection() -> None:
    """A peer that connects and stays silent (half-open, or a port scanner) is greeted on its own
    thread: a good peer right behind it is accepted at once, not after GREET_TIMEOUT_S."""
    from halfmoon.transport.tcp import parse_address
    from halfmoon.transport.ucxx_channel import close_held
    from halfmoon.transport.ucxx_listener import GREET_TIMEOUT_S
    from halfmoon.transport.ucxx_runtime import current_runtime

    backend = get_backend("ucxx")
    listener = backend.listen("127.0.0.1", 0)
    rt = current_runtime()
    host, port = parse_address(listener.address, "ucxx")
    mute = [rt.call(lambda: rt.ucx.UCXEndpoint.create(rt.worker, host, port, True), 10.0, "connect")]
    assert listener.wait_connections(1, 10.0), "the listener never saw the mute connection"
    sender = backend.connect(listener.address, 10.0)
    try:
        start = time.monotonic()
        receiver = listener.accept(GREET_TIMEOUT_S * 2)
        waited = time.monotonic() - start
        assert receiver is not None
        assert waited < GREET_TIMEOUT_S / 2, f"accept waited {waited:.1f} s behind the mute peer"
        sender.sendv([memoryview(b"hello")], 10.0)
        buf = bytearray(16)
        receiver.recv_into([memoryview(buf)], 10.0)
        assert bytes(buf[:5]) == b"hello"
        receiver.close()
    finally:
        sender.close()
        rt.call(lambda: close_held(mute), 10.0, "close")
        listener.close()


def test_closing_the_listener_wakes_a_waiting_accept() -> None:
    """accept() returns None at once when the listener closes, whether it was already waiting
    or comes a moment later (close leaves a wake-up in the queue for every accept)."""
    backend = get_backend("ucxx")
    listener = backend.listen("127.0.0.1", 0)
    got: list[Channel | None] = ["unset"]  # type: ignore[list-item]
    accepting = threading.Event()

    def accept() -> None:
        accepting.set()
        got[0] = listener.accept(30.0)

    t = threading.Thread(target=accept)
    t.start()
    assert accepting.wait(5.0)
    listener.close()
    t.join(5.0)
    assert not t.is_alive() and got[0] is None
    assert listener.accept(30.0) is None  # and every later accept, at once
