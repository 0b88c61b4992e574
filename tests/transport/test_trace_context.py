"""The trace context across the KV transport: the sender's traceparent rides in DONE to the
receiver's result, and a recording receiver lists every verified unit (tracing's per-layer
events); without either, the result carries none (the wire stays what it was)."""

from __future__ import annotations

from tests.transport.conftest import kv_tensor
from halfmoon.transport.frames import new_hash

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_traceparent_and_units_reach_a_recording_receiver(make_pair) -> None:  # noqa: ANN001
    pair = make_pair(kv_tensor(8, seed=1), kv_tensor(8))
    pair.receiver.expect("r1", [4, 5], record=True)
    stream = pair.sender.open("r1", [4, 5], traceparent=TRACEPARENT, record=True)
    for layer in range(3):
        stream.send_layer(layer, [0, 1], [4, 5])
    stream.finish({"first_token": 7})
    result = pair.receiver.wait("r1", 10)
    stream.wait(10)
    assert result.traceparent == TRACEPARENT and result.meta == {"first_token": 7}
    assert [u.layer for u in result.units] == [0, 1, 2]
    assert all(u.blocks == 2 and u.nbytes == pair.layout.unit_bytes(2) for u in result.units)
    for u in result.units:  # the checksum of what arrived: xxh3-64 of the layer's two blocks
        h = new_hash()
        for view in pair.receiver.kv.views(u.layer, [4, 5]):
            h.update(view)
        assert u.checksum == h.intdigest()
    assert 0 < result.first_unit_ns <= result.units[0].at_ns <= result.units[-1].at_ns
    assert [(u.layer, u.blocks) for u in stream.log or []] == [(0, 2), (1, 2), (2, 2)]


def test_without_tracing_nothing_is_recorded_or_sent(make_pair) -> None:  # noqa: ANN001
    pair = make_pair(kv_tensor(8, seed=2), kv_tensor(8))
    pair.receiver.expect("r2", [1])
    stream = pair.sender.open("r2", [1])
    stream.send_layer(0, [3], [1])
    stream.finish({})
    result = pair.receiver.wait("r2", 10)
    stream.wait(10)
    assert result.traceparent is None and result.units == () and result.first_unit_ns == 0
    assert stream.log is None and stream.traceparent is None
