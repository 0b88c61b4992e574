"""Staged KV transfer (transport/staging.py) over host memory: the ring's slot protocol, the
copier's events, and real senders and receivers on every backend moving KV through staging
slots (HostCopier: the CUDA copier's protocol with a copy thread as the stream), the handshake
naming the path and the receiver counting bytes by it.

The CUDA copier (pinned slots, side stream, torch.cuda.Event per layer) runs in
`test_cuda_staged_transfer`, skipped where there is no CUDA device."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.transport.conftest import FINGERPRINT, kv_tensor
from tests.waiting import wait_until
from halfmoon.transport import KVLayout, KVReceiver, KVSender
from halfmoon.transport.channel import Backend
from halfmoon.transport.errors import ProtocolError, TransferTimeoutError
from halfmoon.transport.faults import FaultInjector
from halfmoon.transport.layout import KVBytes
from halfmoon.transport.staging import HOST, STAGED, HostCopier, Slot, Stager, StagingRing, send_path

SLAB = 16 * 1 * 32 * 4  # kv_tensor's bytes of one block's K (or V) in one layer


def host_stager(kv: torch.Tensor, slots: int, blocks_per_slot: int) -> Stager:
    return Stager(kv, StagingRing(slots, blocks_per_slot * 2 * SLAB), HostCopier())


class RecordingRing(StagingRing):
    """The real ring, logging (op, slot, layer) and checking at each acquire that the slot's
    previous unit was released (the ring's own free list is what is under test)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.log: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()

    def acquire(self, timeout: float) -> Slot:
        slot = super().acquire(timeout)
        with self._lock:
            self.log.append(("acquire", slot.index, -1))
        return slot

    def release(self, slot: Slot) -> None:
        with self._lock:
            self.log.append(("release", slot.index, slot.layer))
        super().release(slot)


def test_ring_hands_out_slots_fifo_and_waits_when_all_are_in_flight() -> None:
    ring = StagingRing(2, 64)
    a, b = ring.acquire(1.0), ring.acquire(1.0)
    assert (a.index, b.index, ring.in_use) == (0, 1, 2)
    with pytest.raises(TransferTimeoutError):
        ring.acquire(0.05)
    ring.release(a)
    assert ring.acquire(1.0) is a  # the freed slot, not a new one
    ring.release(b)
    with pytest.raises(ValueError, match="twice"):
        ring.release(b)
    ring.check_integrity()


def test_a_waiting_stage_gets_the_slot_its_send_frees() -> None:
    ring = StagingRing(1, 64)
    held = ring.acquire(1.0)
    got: list[Slot] = []
    waiter = threading.Thread(target=lambda: got.append(ring.acquire(5.0)))
    waiter.start()
    ring.release(held)
    waiter.join(5.0)
    assert got == [held] and ring.in_use == 1


def test_a_staged_slot_holds_the_units_payload() -> None:
    kv = kv_tensor(8, seed=1)
    stager = host_stager(kv, 2, 4)
    ids = [5, 1, 2]
    slot = stager.stage(1, ids, 1.0)
    assert slot.event is not None and slot.event.wait(5.0)
    expected = b"".join(bytes(v) for v in KVBytes(kv).views(1, ids))  # | K slabs | V slabs |
    assert bytes(slot.view()) == expected
    with pytest.raises(ValueError, match="do not fit"):
        stager.stage(0, list(range(5)), 1.0)
    stager.ring.release(slot)
    stager.close()


def test_a_device_tensor_takes_the_staged_path() -> None:
    assert send_path(kv_tensor(2)) == HOST
    assert send_path(torch.empty(1, 2, 1, 1, 1, 1, device="meta")) == STAGED


def transfer(backend: Backend, src: torch.Tensor, dst: torch.Tensor, sender_stager: Stager | None,
             receiver_stager: Stager | None, layers: range, src_ids: list[int], dst_ids: list[int],
             faults: FaultInjector | None = None) -> KVReceiver:
    layout = KVLayout.of(src, FINGERPRINT)
    receiver = KVReceiver(dst, layout, backend, timeout=5.0, stager=receiver_stager, faults=faults).start()
    sender = KVSender(src, layout, backend, receiver.address, timeout=5.0, stager=sender_stager)
    try:
        receiver.expect("r1", dst_ids, record=True)
        stream = sender.open("r1", dst_ids)
        for layer in layers:
            stream.send_layer(layer, src_ids, dst_ids)
        stream.finish({"first_token": 7})
        stream.wait(10.0)
        result = receiver.wait("r1", 10.0)
        assert result.meta == {"first_token": 7}
        layers_seen = [u.layer for u in result.units]
        assert layers_seen == sorted(layers_seen), "a request's units arrive in layer order"
        return receiver
    finally:
        sender.close()
        receiver.close()


def test_staged_units_reach_the_receiver_intact_through_a_small_ring(backend: Backend) -> None:
    src, dst = kv_tensor(12, seed=3), kv_tensor(12)
    ring = RecordingRing(2, 2 * 2 * SLAB)  # 2 slots of 2 blocks: 5 blocks = 3 units a layer
    stager = Stager(src, ring, HostCopier())
    faults = FaultInjector()
    faults.receive_delay = 0.005  # a slow receiver: the sends, and the slots, stay busy longer
    src_ids, dst_ids = [0, 1, 2, 3, 7], [11, 4, 5, 6, 9]
    receiver = transfer(backend, src, dst, stager, None, range(3), src_ids, dst_ids, faults)
    assert torch.equal(dst[:, :, dst_ids], src[:, :, src_ids])
    assert receiver.stats.bytes_by_path == {STAGED: 3 * 5 * 2 * SLAB}
    wait_until(lambda: ring.in_use == 0, 5.0, "every slot released once its send completed")
    ring.check_integrity()
    held: dict[int, bool] = {}
    for op, index, _ in ring.log:  # a slot is acquired again only after its release
        assert held.get(index, False) is (op == "release"), f"slot {index}: {op} out of turn"
        held[index] = op == "acquire"
    released_layers = [layer for op, _, layer in ring.log if op == "release"]
    assert released_layers == sorted(released_layers) and len(released_layers) == 9
    stager.close()


def test_a_receiver_with_staging_lands_units_in_its_blocks(backend: Backend) -> None:
    src, dst = kv_tensor(8, seed=4), kv_tensor(8)
    landing = host_stager(dst, 3, 4)
    receiver = transfer(backend, src, dst, None, landing, range(3), [1, 2, 3], [6, 0, 2])
    assert torch.equal(dst[:, :, [6, 0, 2]], src[:, :, [1, 2, 3]])
    assert receiver.stats.bytes_by_path == {HOST: 3 * 3 * 2 * SLAB}
    assert landing.ring.in_use == 0
    landing.ring.check_integrity()
    landing.close()


def test_a_unit_larger_than_the_receivers_slots_is_a_clear_error() -> None:
    stager = host_stager(kv_tensor(4), 1, 1)
    with pytest.raises(ProtocolError, match="kv-max-inflight-mb"):
        stager.landing(4 * SLAB, 1.0)
    stager.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="stages from device memory; this machine has no CUDA device")
def test_cuda_staged_transfer() -> None:
    from halfmoon.transport import get_backend

    src, dst = kv_tensor(12, seed=5).cuda(), kv_tensor(12).cuda()
    receiver = transfer(get_backend("tcp"), src, dst, None, None, range(3), [0, 1, 2, 3, 7], [11, 4, 5, 6, 9])
    assert torch.equal(dst[:, :, [11, 4, 5, 6, 9]], src[:, :, [0, 1, 2, 3, 7]])
    assert set(receiver.stats.bytes_by_path) == {STAGED}
