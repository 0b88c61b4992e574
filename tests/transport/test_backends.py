"""The suite every backend passes: bit-exact delivery into the right blocks, concurrency, sizes
from 4 KB to 256 MB, completion, cancellation, and the receiver's guards."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from tests.transport.conftest import kv_tensor
from halfmoon.transport.errors import ProtocolError, TransferCancelledError, TransferTimeoutError


def push(pair, rid: str, src: list[int], dst: list[int], layers=None, meta=None) -> None:  # noqa: ANN001
    stream = pair.sender.open(rid, dst)
    for layer in layers if layers is not None else range(pair.layout.num_layers):
        stream.send_layer(layer, src, dst)
    stream.finish(meta)
    return stream


def test_random_block_tables_arrive_bit_exact(make_pair) -> None:  # noqa: ANN001
    pair = make_pair(kv_tensor(64, seed=1), kv_tensor(64))
    rng = random.Random(0)
    for i in range(5):
        n = rng.randint(1, 20)
        src, dst = rng.sample(range(64), n), rng.sample(range(64), n)
        before = pair.dst.clone()
        pair.receiver.expect(f"r{i}", dst)
        stream = push(pair, f"r{i}", src, dst, meta={"first_token": i})
        result = pair.receiver.wait(f"r{i}", 10)
        stream.wait(10)
        assert result.meta == {"first_token": i} and result.num_units == 3
        assert result.num_bytes == 3 * pair.layout.unit_bytes(n)
        assert torch.equal(pair.dst[:, :, dst], pair.src[:, :, src])
        untouched = [b for b in range(64) if b not in dst]
        assert torch.equal(pair.dst[:, :, untouched], before[:, :, untouched])


def test_many_concurrent_requests(make_pair) -> None:  # noqa: ANN001
    pair = make_pair(kv_tensor(256, seed=2), kv_tensor(256))
    dst_all = list(range(256))
    random.Random(1).shuffle(dst_all)
    jobs = [(f"c{i}", list(range(i * 16, i * 16 + 16)), dst_all[i * 16 : i * 16 + 16]) for i in range(16)]
    for rid, _, dst in jobs:
        pair.receiver.expect(rid, dst)
    errors: list[BaseException] = []

    def run(rid: str, src: list[int], dst: list[int]) -> None:
        try:
            push(pair, rid, src, dst).wait(20)
        except BaseException as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    results = [pair.receiver.wait(rid, 20) for rid, _, _ in jobs]
    for t in threads:
        t.join()
    assert not errors and all(r.num_units == 3 for r in results)
    for _, src, dst in jobs:
        assert torch.equal(pair.dst[:, :, dst], pair.src[:, :, src])


@pytest.mark.parametrize("nbytes", [4 << 10, 1 << 20, 64 << 20, 256 << 20], ids=["4KB", "1MB", "64MB", "256MB"])
def test_message_sizes(make_pair, nbytes: int) -> None:  # noqa: ANN001
    blocks = nbytes // (4 << 10)  # one layer's unit is 4 KB per block
    src_kv, dst_kv = kv_tensor(blocks + 1, layers=1, seed=3), kv_tensor(blocks + 1, layers=1)
    pair = make_pair(src_kv, dst_kv)
    src = list(range(blocks))
    dst = list(range(1, blocks + 1))  # shifted by one: every byte lands somewhere else
    pair.receiver.expect("big", dst)
    push(pair, "big", src, dst).wait(60)
    assert pair.receiver.wait("big", 60).num_bytes == nbytes
    assert torch.equal(dst_kv[:, :, 1:], src_kv[:, :, :-1])


def test_a_unit_whose_block_list_outgrows_a_control_message(make_pair) -> None:  # noqa: ANN001
    """20,000 shuffled block ids: the UNIT body (80 KB of ids plus the frame cuts) travels in
    several control frames, and the payload, cut into many staged frames, still lands bit-exact."""
    n = 20_000
    src_kv, dst_kv = kv_tensor(n, layers=1, seed=5, head_dim=4), kv_tensor(n, layers=1, head_dim=4)
    pair = make_pair(src_kv, dst_kv)
    rng = random.Random(2)
    src, dst = rng.sample(range(n), n), rng.sample(range(n), n)
    pair.receiver.expect("wide", dst)
    push(pair, "wide", src, dst).wait(60)
    assert pair.receiver.wait("wide", 60).num_units == 1
    assert torch.equal(dst_kv[:, :, dst], src_kv[:, :, src])


def test_messages_with_large_bodies_keep_their_order(backend) -> None:  # noqa: ANN001
    """Bodies of 0 B .. 3 control frames and a bit, back to back, each read whole and in order:
    the largest inline body, one byte more (the first body in frames of its own), and more."""
    from tests.transport.conftest import accept_pair
    from halfmoon.transport.protocol import CONTROL_BYTES, INLINE_BODY_BYTES, Header, Kind, recv_msg, send_msg

    listener = backend.listen("127.0.0.1", 0)
    try:
        a, b = accept_pair(backend, listener)
        sizes = [0, 10, INLINE_BODY_BYTES, INLINE_BODY_BYTES + 1, CONTROL_BYTES, 3 * CONTROL_BYTES + 7, 5]
        bodies = [bytes(random.Random(i).randbytes(size)) for i, size in enumerate(sizes)]
        sender = threading.Thread(target=lambda: [send_msg(a, Header(Kind.DONE, count=i), body, 10)
                                                  for i, body in enumerate(bodies)])
        sender.start()  # the local backend's sends wait for their receives
        for i, body in enumerate(bodies):
            header, got = recv_msg(b, 10, 10)
            assert (header.count, got) == (i, body)
        sender.join(10)
        a.close()
        b.close()
    finally:
        listener.close()


def test_units_outside_the_reservation_are_refused(make_pair) -> None:  # noqa: ANN001
    pair = make_pair(kv_tensor(16, seed=4), kv_tensor(16))
    pair.receiver.expect("r", [0, 1])
    push(pair, "r", [0, 1, 2], [0, 1, 5])
    with pytest.raises(ProtocolError, match="did not reserve"):
        pair.receiver.wait("r", 10)
    assert not pair.dst.any(), "a refused unit must not write anything"


def test_unknown_request_is_drained_not_written(make_pair) -> None:  # noqa: ANN001
    pair = make_pair(kv_tensor(16, seed=5), kv_tensor(16))
    stream = push(pair, "nobody-expects-me", [0, 1], [0, 1])
    with pytest.raises(TransferCancelledError):
        stream.wait(10)
    assert not pair.dst.any()
    pair.receiver.expect("next", [3])  # the connection is still good
    push(pair, "next", [4], [3]).wait(10)
    assert torch.equal(pair.dst[:, :, 3], pair.src[:, :, 4])


def test_sender_cancel(make_pair) -> None:  # noqa: ANN001
    pair = make_pair(kv_tensor(16, seed=6), kv_tensor(16))
    pair.receiver.expect("r", [0, 1])
    stream = pair.sender.open("r", [0, 1])
    stream.send_layer(0, [2, 3], [0, 1])
    stream.cancel()
    with pytest.raises(TransferCancelledError):
        stream.wait(1)
    with pytest.raises(TransferCancelledError, match="by the sender"):
        pair.receiver.wait("r", 10)


def test_receiver_cancel_stops_writes(make_pair) -> None:  # noqa: ANN001
    pair = make_pair(kv_tensor(16, seed=7), kv_tensor(16))
    pair.receiver.expect("r", [0, 1])
    pair.receiver.cancel("r")
    stream = push(pair, "r", [2, 3], [0, 1])
    with pytest.raises(TransferCancelledError):
        stream.wait(10)
    assert not pair.dst.any()
    assert pair.receiver.pending() == []


def test_wait_times_out_and_forgets(make_pair) -> None:  # noqa: ANN001
    pair = make_pair(kv_tensor(8, seed=8), kv_tensor(8))
    pair.receiver.expect("late", [0])
    with pytest.raises(TransferTimeoutError, match="incomplete"):
        pair.receiver.wait("late", 0.3)
    assert pair.receiver.pending() == []


def test_finished_stream_refuses_more_units(make_pair) -> None:  # noqa: ANN001
    pair = make_pair(kv_tensor(8, seed=9), kv_tensor(8))
    pair.receiver.expect("r", [0])
    stream = push(pair, "r", [1], [0])
    with pytest.raises(ProtocolError, match="already finished"):
        stream.send_layer(0, [1], [0])
    stream.wait(10)
    pair.receiver.wait("r", 10)
