"""Helpers the transport tests share (not tests, not fixtures: those are in conftest.py; the
bounded wait is tests.waiting)."""

from __future__ import annotations

import hashlib
import os

import torch

from halfmoon.bench.transport_bench import Peer
from tests.transport.conftest import FINGERPRINT, kv_tensor
from halfmoon.transport.blocks import BlockServer
from halfmoon.transport.channel import Backend
from halfmoon.transport.layout import KVLayout

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def peer_process(*args: str) -> Peer:
    """`tests.transport.peer` in its own process (see its docstring for `args` and ops)."""
    return Peer(args, module="tests.transport.peer", cwd=REPO)


# Block pulls (transport.blocks): a holder serving a dict of random blocks.

BLOCK_BYTES = 4096


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()[:16]


class Holder:
    """A block server over a dict of blocks (what KVTiers.serve_blocks does, in memory)."""

    def __init__(self, backend: Backend, blocks: dict[bytes, torch.Tensor], **kw: object) -> None:
        self.blocks = blocks
        self.layout = KVLayout.of(kv_tensor(4), FINGERPRINT)
        self.server = BlockServer(self.serve, self.layout, BLOCK_BYTES, backend, **kw).start()

    def serve(self, hashes: list[bytes], rows: torch.Tensor) -> int:
        for i, h in enumerate(hashes):
            if h not in self.blocks:
                return i
            rows[i] = self.blocks[h]
        return len(hashes)


def random_blocks(n: int, seed: int = 0) -> dict[bytes, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {key(i): torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=gen) for i in range(n)}
