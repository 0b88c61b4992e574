"""A UCX worker whose shared-memory receive queue a dead peer wedged is found and replaced
(transport.ucxx_recovery).

The wedge is made on purpose here, the way a sender killed mid-send leaves it: the next slot of
this process's sysv FIFO is claimed (its head bumped) and never published. That is what
`test_faults.py::test_sender_killed_mid_transfer_releases_the_receivers_blocks[ucxx]` hits by
chance (about one kill in four); it checks the same recovery end to end.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Iterator

import numpy as np
import pytest

from tests.transport.conftest import accept_pair, thread_cpu_s
from tests.waiting import poll
from halfmoon.transport import get_backend, ucxx_recovery
from halfmoon.transport import ucxx_runtime as ur
from halfmoon.transport.channel import Channel, Listener
from halfmoon.transport.errors import PeerLostError

FIFO_BYTES = 36864  # UCX 1.21's default sysv receive FIFO: control + 256 x 128-byte slots, page-rounded
ARMED = 1 << 63  # a flag bit in the FIFO head (UCT_MM_IFACE_FIFO_HEAD_EVENT_ARMED)


def wedge_shared_memory_queues() -> int:
    """Claim the next slot of every sysv receive FIFO this process created, as a writer killed
    between claiming and publishing would. Returns how many were wedged."""
    with open("/proc/sysvipc/shm") as f:
        rows = [line.split() for line in f.read().splitlines()[1:]]
    fifos = [int(r[1]) for r in rows if int(r[4]) == os.getpid() and int(r[3]) == FIFO_BYTES]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype, libc.shmat.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    libc.shmdt.argtypes = [ctypes.c_void_p]
    for shmid in fifos:
        addr = libc.shmat(shmid, None, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), f"shmat({shmid}) failed: errno {ctypes.get_errno()}"
        head = ctypes.c_uint64.from_address(addr)  # the FIFO control block starts the segment
        head.value = (head.value & ~ARMED) + 1
        libc.shmdt(ctypes.c_void_p(addr))
    return len(fifos)


def pair(listener: Listener) -> tuple[Channel, Channel]:
    return accept_pair(get_backend("ucxx"), listener)


def round_trip(sender: Channel, receiver: Channel) -> None:
    sender.sendv([memoryview(b"still here")], 10.0)
    buf = bytearray(10)
    receiver.recv_into([memoryview(buf)], 10.0)
    assert bytes(buf) == b"still here"


@pytest.fixture
def listener() -> Iterator[Listener]:
    listener = get_backend("ucxx").listen("127.0.0.1", 0)
    yield listener
    listener.close()


def test_a_healthy_worker_passes_the_probe() -> None:
    get_backend("ucxx")
    assert ucxx_recovery.probe(ur.current_runtime(), timeout=5.0)


def test_a_peer_closing_leaves_a_healthy_worker_in_place(listener: Listener,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    assert ucxx_recovery.settled(20.0)  # no check left over from an earlier test's lost peer
    probes: list[bool] = []
    real = ucxx_recovery.probe
    monkeypatch.setattr(ucxx_recovery, "probe", lambda rt, timeout=5.0: probes.append(real(rt, timeout)) or probes[-1])
    before = ur.current_runtime()
    sender, receiver = pair(listener)
    sender.close()  # the receiver's endpoint is closed by its peer: the worker gets checked
    assert poll(lambda: probes, 10.0), "the worker was not checked after its peer left"
    assert ucxx_recovery.settled(20.0)
    receiver.close()
    # Every check found the worker healthy (an earlier test's peer may still cause one more).
    assert all(probes) and ur.current_runtime() is before


def test_a_wedged_queue_is_found_and_the_worker_replaced(listener: Listener,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    assert ucxx_recovery.settled(20.0)  # no check left over from an earlier test's lost peer
    old = ur.current_runtime()
    bystander_tx, bystander_rx = pair(listener)  # a channel that is open when the wedge happens
    leaving_tx, leaving_rx = pair(listener)  # a peer that will go away
    buf = np.zeros(64, np.uint8)
    posted = bystander_rx.post_recvs([[memoryview(buf)]])
    assert wedge_shared_memory_queues() >= 1, "found no sysv receive FIFO of this process (UCX changed?)"
    assert not ucxx_recovery.probe(old, timeout=2.0), "the wedge did not take: UCX's FIFO layout changed?"
    leaving_tx.close()  # the peer goes away: the check that finds the wedge
    assert poll(lambda: old.retired, 30.0), "the wedged worker was not replaced"
    assert ucxx_recovery.settled(30.0)
    new = ur.current_runtime()
    assert new is not old and old.retired
    assert "no longer receives from new peers" in caplog.text
    with pytest.raises(PeerLostError):  # the old worker's channels were closed ...
        posted.wait(0, 10.0)
    with pytest.raises(PeerLostError):
        bystander_tx.sendv([memoryview(b"x")], 5.0)
    sender, receiver = pair(listener)  # ... and the listener kept its address on the new one
    try:
        round_trip(sender, receiver)
        assert ucxx_recovery.probe(new, timeout=5.0)
        before = thread_cpu_s(old.owner.native_id)
        time.sleep(1.0)  # the thing under test: the retired owner thread's CPU over an idle second
        used = thread_cpu_s(old.owner.native_id) - before
        assert used < 0.2, f"the replaced worker's owner thread used {used:.2f} s of CPU in 1 s"
    finally:
        for channel in (sender, receiver, bystander_tx, bystander_rx, leaving_rx):
            channel.close()
