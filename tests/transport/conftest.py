"""Fixtures for the transport suite: every backend runs the same tests."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch

from halfmoon.transport import KVLayout, KVReceiver, KVSender, get_backend
from halfmoon.transport.channel import Backend, Channel, Listener

BACKENDS = ["local", "tcp", "ucxx"]
FINGERPRINT = "test-layout"


def kv_tensor(num_blocks: int, layers: int = 3, seed: int | None = None, head_dim: int = 32) -> torch.Tensor:
    """[layers, 2, blocks, 16, 1, head_dim] fp32: 4 KB per block per layer (K + V) at head_dim 32."""
    shape = (layers, 2, num_blocks, 16, 1, head_dim)
    if seed is None:
        return torch.zeros(shape)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    return get_backend(request.param)


class Pair:
    """A receiver over `dst` and a connected sender over `src` on one backend."""

    def __init__(self, backend: Backend, src: torch.Tensor, dst: torch.Tensor, **sender_kw: object) -> None:
        self.src, self.dst = src, dst
        self.layout = KVLayout.of(src, FINGERPRINT)
        self.receiver = KVReceiver(dst, KVLayout.of(dst, FINGERPRINT), backend, timeout=5.0).start()
        self.sender = KVSender(src, self.layout, backend, self.receiver.address, timeout=5.0, **sender_kw)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


@pytest.fixture
def make_pair(backend: Backend) -> Iterator:
    pairs: list[Pair] = []

    def build(src: torch.Tensor, dst: torch.Tensor, **kw: object) -> Pair:
        pairs.append(Pair(backend, src, dst, **kw))
        return pairs[-1]

    yield build
    for p in pairs:
        p.close()


def accept_pair(backend: Backend, listener: Listener) -> tuple[Channel, Channel]:
    """A channel from `backend` to `listener` and the channel `listener` accepted for it."""
    accepted: list[Channel | None] = []
    t = threading.Thread(target=lambda: accepted.append(listener.accept(10.0)))
    t.start()
    sender = backend.connect(listener.address, 10.0)
    t.join(15.0)
    assert accepted and accepted[0] is not None, "the listener did not accept"
    return sender, accepted[0]


def thread_cpu_s(tid: int) -> float:
    """CPU time (user + system) thread `tid` of this process has used so far."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
