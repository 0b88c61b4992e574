"""TransportBlockReader: the engine's remote block reads over the transport. The holder's
address is cached while fetches from it work, and asked again after one failed, but not after a
plain miss (the holder simply lacks the block)."""

from __future__ import annotations

import torch

from halfmoon.engine.worker import TransportBlockReader
from tests.transport.conftest import FINGERPRINT, kv_tensor
from tests.transport.helpers import BLOCK_BYTES, Holder, key, random_blocks
from halfmoon.transport import KVLayout
from halfmoon.transport.blocks import BlockClient
from halfmoon.transport.channel import get_backend


def test_the_holder_address_is_cached_until_a_fetch_fails() -> None:
    backend = get_backend("tcp")
    holder = Holder(backend, random_blocks(4))
    asked: list[str] = []

    def resolve(h: str) -> str:
        asked.append(h)
        return holder.server.address

    reader = TransportBlockReader(resolve, timeout_s=5.0)
    reader.client = BlockClient(holder.layout, backend, timeout=5.0)
    dst = torch.zeros(4, BLOCK_BYTES, dtype=torch.uint8)
    try:
        assert reader.fetch("w1", [key(i) for i in range(4)], dst) == 4
        assert torch.equal(dst[2], holder.blocks[key(2)])
        assert reader.fetch("w1", [key(99)], dst) == 0  # a miss: no failure, address kept
        assert (asked, reader.failures) == (["w1"], 0)
        holder.server.close()
        assert reader.fetch("w1", [key(0)], dst) == 0  # the holder is gone: a failure
        assert reader.failures == 1
        assert reader.fetch("w1", [key(0)], dst) == 0
        assert asked == ["w1", "w1"] and reader.failures == 2  # asked again after the failure
    finally:
        reader.close()
        holder.server.close()


def test_an_unresolvable_holder_is_a_failure_not_an_exception() -> None:
    def resolve(h: str) -> str:
        raise RuntimeError(f"{h} is gone")

    reader = TransportBlockReader(resolve)
    reader.client = BlockClient(KVLayout.of(kv_tensor(4), FINGERPRINT), get_backend("tcp"), timeout=5.0)
    assert reader.fetch("w9", [key(0)], torch.zeros(1, BLOCK_BYTES, dtype=torch.uint8)) == 0
    assert reader.failures == 1
    reader.close()
