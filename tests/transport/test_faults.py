"""Faults: handshake mismatches, corrupted units, a slow receiver, peers killed mid-transfer."""

from __future__ import annotations

import os
import signal
import time
import tracemalloc
from dataclasses import replace
from unittest import mock

import pytest
import torch

from halfmoon.kvpool.block_pool import BlockPool
from tests.transport.conftest import FINGERPRINT, kv_tensor
from tests.transport.helpers import peer_process
from tests.transport.peer import RAW_FINGERPRINT, raw_kv
from tests.waiting import poll
from halfmoon.transport import KVLayout, KVReceiver, KVSender, get_backend, protocol
from halfmoon.transport.channel import Backend
from halfmoon.transport.errors import (
    ChecksumError,
    HandshakeError,
    PeerLostError,
    TransferTimeoutError,
)
from halfmoon.transport.faults import FaultInjector


def receiver_for(backend: Backend, kv: torch.Tensor, secret: bytes | None = None, **kw) -> KVReceiver:  # noqa: ANN003
    return KVReceiver(kv, KVLayout.of(kv, FINGERPRINT), backend, secret=secret, timeout=5.0, **kw).start()


# ---------------------------------------------------------------- handshake


@pytest.mark.parametrize("field,change", [
    ("fingerprint", {"fingerprint": "other-model"}),
    ("head_dim", {"head_dim": 64}),
    ("dtype", {"dtype": "bfloat16"}),
    ("block_size", {"block_size": 32}),
    ("num_layers", {"num_layers": 7}),
])
def test_layout_mismatch_is_refused_naming_the_field(backend: Backend, field: str, change: dict) -> None:
    kv = kv_tensor(8)
    receiver = receiver_for(backend, kv)
    try:
        with pytest.raises(HandshakeError) as err:
            KVSender(kv, replace(KVLayout.of(kv, FINGERPRINT), **change), backend, receiver.address, timeout=5.0)
        assert err.value.field == field and field in str(err.value)
        assert receiver.stats.refused == 1 or poll(lambda: receiver.stats.refused == 1, 5.0)
    finally:
        receiver.close()


def test_version_mismatch_is_refused(backend: Backend) -> None:
    kv = kv_tensor(8)
    receiver = receiver_for(backend, kv)
    try:
        old_hello = protocol.hello
        newer = mock.patch("halfmoon.transport.protocol.hello", side_effect=lambda *a: {**old_hello(*a), "version": 99})
        with newer, pytest.raises(HandshakeError) as err:
            KVSender(kv, KVLayout.of(kv, FINGERPRINT), backend, receiver.address, timeout=5.0)
        assert err.value.field == "version" and "99" in str(err.value)
    finally:
        receiver.close()


@pytest.mark.parametrize("mine,theirs,match", [
    (b"s3cret", b"other", "secrets differ"),
    (b"s3cret", None, "requires a shared secret"),
    (None, b"s3cret", "has none configured"),
])
def test_secret_mismatch_is_refused(backend: Backend, mine: bytes | None, theirs: bytes | None, match: str) -> None:
    kv = kv_tensor(8)
    receiver = receiver_for(backend, kv, secret=mine)
    try:
        with pytest.raises(HandshakeError, match=match) as err:
            KVSender(kv, KVLayout.of(kv, FINGERPRINT), backend, receiver.address, secret=theirs, timeout=5.0)
        assert err.value.field == "secret"
    finally:
        receiver.close()


def test_matching_secret_is_accepted(backend: Backend) -> None:
    src, dst = kv_tensor(8, seed=1), kv_tensor(8)
    receiver = receiver_for(backend, dst, secret=b"s3cret")
    sender = KVSender(src, KVLayout.of(src, FINGERPRINT), backend, receiver.address, secret=b"s3cret", timeout=5.0)
    try:
        receiver.expect("r", [2])
        stream = sender.open("r", [2])
        stream.send_layer(0, [5], [2])
        stream.finish()
        stream.wait(10)
        assert torch.equal(dst[0, :, 2], src[0, :, 5])
    finally:
        sender.close()
        receiver.close()


# ---------------------------------------------------------------- corruption


def test_flipped_bit_is_detected_and_the_data_never_used(backend: Backend) -> None:
    src, dst = kv_tensor(16, seed=2), kv_tensor(16)
    faults = FaultInjector()
    receiver = receiver_for(backend, dst)
    sender = KVSender(src, KVLayout.of(src, FINGERPRINT), backend, receiver.address, timeout=5.0, faults=faults)
    try:
        faults.corrupt_next(request_id="bad", layer=1)
        streams = {}
        for rid, dst_ids in (("bad", [0, 1]), ("good", [2, 3])):
            receiver.expect(rid, dst_ids)
            streams[rid] = sender.open(rid, dst_ids)
            for layer in range(3):
                streams[rid].send_layer(layer, [4, 5], dst_ids)
            streams[rid].finish()
        with pytest.raises(ChecksumError) as err:
            receiver.wait("bad", 10)
        assert err.value.layer == 1 and err.value.expected != err.value.actual
        assert receiver.stats.checksum_failures == 1 and faults.injected == 1
        with pytest.raises(ChecksumError):  # the sender is told too
            streams["bad"].wait(10)
        assert receiver.wait("good", 10).num_units == 3  # the connection survives
        streams["good"].wait(10)
    finally:
        sender.close()
        receiver.close()


# ---------------------------------------------------------------- slow receiver


def test_slow_receiver_keeps_sender_memory_bounded(backend: Backend) -> None:
    cap = 4 << 20
    src, dst = kv_tensor(1024, layers=4, seed=3), kv_tensor(1024, layers=4)
    faults = FaultInjector()
    faults.receive_delay = 2.0  # longer than the sender's timeout
    receiver = receiver_for(backend, dst, faults=faults)
    sender = KVSender(src, KVLayout.of(src, FINGERPRINT), backend, receiver.address, timeout=1.0,
                      max_inflight_bytes=cap)
    try:
        receiver.expect("r", list(range(1024)))
        stream = sender.open("r", list(range(1024)))
        tracemalloc.start()
        with pytest.raises(TransferTimeoutError):  # backpressure, or the send itself timing out
            for _ in range(64):  # 64 x 4 layers x 1 MB = 256 MB offered, far beyond the cap
                for layer in range(4):
                    stream.send_layer(layer, list(range(256)), list(range(256)))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert sender.stats.peak_inflight_bytes <= cap
        assert peak < 2 * cap, f"sender allocated {peak} bytes for a {cap}-byte in-flight cap"
    finally:
        sender.close()
        receiver.close()


# ---------------------------------------------------------------- peers in other processes


PROCESS_BACKENDS = ["tcp", "ucxx"]


@pytest.mark.parametrize("name", PROCESS_BACKENDS)
def test_receiver_killed_mid_transfer_fails_the_sender_within_timeout(name: str) -> None:
    peer = peer_process("receiver", "--backend", name)
    kv = raw_kv(1)
    sender = KVSender(kv, KVLayout.of(kv, RAW_FINGERPRINT), get_backend(name), peer.first["address"], timeout=3.0)
    try:
        blocks = list(range(4096))
        assert peer.ask(op="expect", rid="r", blocks=blocks) == {"ok": True}
        stream = sender.open("r", blocks)
        for layer in range(2):
            stream.send_layer(layer, blocks, blocks)  # 2 x 16 MB
        os.kill(peer.proc.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises((PeerLostError, TransferTimeoutError)):
            for _ in range(20):
                stream.send_layer(0, blocks, blocks)
            stream.finish()
            stream.wait(10)
        assert time.monotonic() - start < 3.0 + 5.0
    finally:
        sender.close()
        peer.kill()


@pytest.mark.parametrize("name", PROCESS_BACKENDS)
def test_sender_killed_mid_transfer_releases_the_receivers_blocks(name: str) -> None:
    kv = raw_kv(None)
    num_blocks = kv.shape[2]
    pool = BlockPool(num_blocks)
    receiver = KVReceiver(kv, KVLayout.of(kv, RAW_FINGERPRINT), get_backend(name), timeout=2.0).start()
    peer = None
    try:
        blocks = pool.allocate(num_blocks)  # the peer writes blocks 0..n-1: reserve them all
        receiver.expect("victim", blocks)
        peer = peer_process("sender", "--backend", name, "--address", receiver.address, "--rid", "victim",
                    "--blocks", str(num_blocks))
        assert poll(lambda: receiver.stats.units > 0, 20)
        os.kill(peer.proc.pid, signal.SIGKILL)
        with pytest.raises((PeerLostError, TransferTimeoutError)):
            receiver.wait("victim", 10)
        pool.free(blocks)  # what a decode worker does when wait() raises
        pool.check_integrity()
        assert pool.num_free() == num_blocks and receiver.pending() == []
        _assert_a_new_sender_gets_through(name, receiver, kv)
    finally:
        receiver.close()
        if peer is not None:
            peer.kill()


def _assert_a_new_sender_gets_through(name: str, receiver: KVReceiver, dst: torch.Tensor) -> None:
    """The receiver still takes transfers from new peers. Over ucxx, a sender killed while
    writing into the receiving worker's shared-memory queue wedges it for good (about one kill
    in four here): transport.ucxx_recovery must notice and replace the worker first."""
    if name == "ucxx":
        from halfmoon.transport import ucxx_recovery

        assert ucxx_recovery.settled(20.0), "the UCX worker check after the kill did not finish"
    src = raw_kv(3)
    sender = KVSender(src, KVLayout.of(src, RAW_FINGERPRINT), get_backend(name), receiver.address, timeout=5.0)
    try:
        receiver.expect("after", [7, 9])
        stream = sender.open("after", [7, 9])
        for layer in range(src.shape[0]):
            stream.send_layer(layer, [1, 2], [7, 9])
        stream.finish()
        stream.wait(10)
        receiver.wait("after", 10)
        assert torch.equal(dst[:, :, [7, 9]], src[:, :, [1, 2]])
    finally:
        sender.close()
