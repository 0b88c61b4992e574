"""Fixtures for the transport suite: every backend runs the same tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from transport import KVLayout, KVReceiver, KVSender, get_backend
from transport.channel import Backend

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

