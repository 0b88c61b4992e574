"""Reading KV blocks held by another worker, by hash.

`RemoteBlockReader` is what the pool asks. Between processes the bytes move over the KV
transport (ucxx / tcp): `engine.worker.TransportBlockReader` asks the holder's
`transport.blocks.BlockServer`, checksummed, batch by batch. `InProcessReader` connects workers
living in one process (tests): each registers its `BlockServer` (its `KVTiers`), and a fetch
copies straight from the holder's tiers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

import torch

from halfmoon.kvpool.cluster_index import HolderId


class BlockServer(Protocol):
    def serve_blocks(self, hashes: Sequence[bytes], dst: torch.Tensor) -> int:
        """Copy the leading blocks of `hashes` this holder has into `dst` rows; return how many."""
        ...


class RemoteBlockReader(ABC):
    """Fetches blocks from the holder the cluster index named."""

    @abstractmethod
    def fetch(self, holder: HolderId, hashes: Sequence[bytes], dst: torch.Tensor) -> int:
        """Leading blocks of `hashes` delivered intact into `dst` ([n, block_bytes] uint8)."""


class InProcessReader(RemoteBlockReader):
    """Holders in this process, by id (an unknown or gone holder delivers nothing)."""

    def __init__(self) -> None:
        self._servers: dict[HolderId, BlockServer] = {}

    def register(self, holder: HolderId, server: BlockServer) -> None:
        self._servers[holder] = server

    def unregister(self, holder: HolderId) -> None:
        self._servers.pop(holder, None)

    def fetch(self, holder: HolderId, hashes: Sequence[bytes], dst: torch.Tensor) -> int:
        server = self._servers.get(holder)
        return 0 if server is None else server.serve_blocks(hashes, dst)
