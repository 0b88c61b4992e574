"""Block pulls by hash (transport.blocks) on every backend: bit-exact, leading prefix only,
batched, checksummed, and a failure of any kind is a shorter answer, never an exception."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.transport.conftest import FINGERPRINT, kv_tensor
from tests.transport.helpers import BLOCK_BYTES, Holder, key, random_blocks
from halfmoon.transport.blocks import FETCH_BATCH, BlockClient
from halfmoon.transport.channel import Backend
from halfmoon.transport.faults import FaultInjector
from halfmoon.transport.layout import KVLayout

@pytest.fixture
def holder(backend: Backend) -> Iterator[Holder]:
    h = Holder(backend, random_blocks(3 * FETCH_BATCH + 5))
    yield h
    h.server.close()


def client_for(backend: Backend, holder: Holder, **kw: object) -> BlockClient:
    return BlockClient(holder.layout, backend, timeout=5.0, **kw)


def test_fetch_is_bit_exact_across_batches(backend: Backend, holder: Holder) -> None:
    client = client_for(backend, holder)
    hashes = [key(i) for i in range(3 * FETCH_BATCH + 5)]
    dst = torch.zeros(len(hashes), BLOCK_BYTES, dtype=torch.uint8)
    assert client.fetch(holder.server.address, hashes, dst) == len(hashes)
    assert all(torch.equal(dst[i], holder.blocks[h]) for i, h in enumerate(hashes))
    # Again on the same (cached) connection: the leading prefix only, up to the first miss.
    hashes = [key(i) for i in range(10)] + [key(10_000)] + [key(11)]
    dst = torch.zeros(len(hashes), BLOCK_BYTES, dtype=torch.uint8)
    assert client.fetch(holder.server.address, hashes, dst) == 10
    assert torch.equal(dst[9], holder.blocks[key(9)]) and not dst[10:].any()
    assert client.fetched_blocks == (3 * FETCH_BATCH + 5) + 10 and client.failures == 0
    client.close()


def test_unknown_blocks_and_an_empty_ask_deliver_nothing(backend: Backend, holder: Holder) -> None:
    client = client_for(backend, holder)
    dst = torch.zeros(2, BLOCK_BYTES, dtype=torch.uint8)
    missing = client.fetch_outcome(holder.server.address, [key(10_000), key(0)], dst)
    assert missing.count == 0 and not missing.failed  # a miss, not a failure
    assert client.fetch(holder.server.address, [], dst) == 0
    assert not dst.any() and client.failures == 0
    with pytest.raises(ValueError, match="uint8"):
        client.fetch(holder.server.address, [key(0)], torch.zeros(1, BLOCK_BYTES))
    client.close()


def test_a_flipped_bit_is_detected_and_the_batch_not_used(backend: Backend) -> None:
    faults = FaultInjector()
    holder = Holder(backend, random_blocks(2 * FETCH_BATCH), faults=faults)
    client = client_for(backend, holder)
    try:
        hashes = [key(i) for i in range(2 * FETCH_BATCH)]
        dst = torch.zeros(len(hashes), BLOCK_BYTES, dtype=torch.uint8)
        faults.corrupt_next(request_id="fetch")  # the first batch goes out corrupted
        corrupted = client.fetch_outcome(holder.server.address, hashes, dst)
        assert corrupted.count == 0 and corrupted.failed
        assert client.checksum_failures == 1 and faults.injected == 1
        # The connection is still in step: the next fetch is whole and exact.
        assert client.fetch(holder.server.address, hashes, dst) == len(hashes)
        assert all(torch.equal(dst[i], holder.blocks[h]) for i, h in enumerate(hashes))
    finally:
        client.close()
        holder.server.close()


def test_a_gone_server_is_a_miss_within_the_timeout(backend: Backend) -> None:
    holder = Holder(backend, random_blocks(4))
    client = client_for(backend, holder)
    dst = torch.zeros(4, BLOCK_BYTES, dtype=torch.uint8)
    assert client.fetch(holder.server.address, [key(i) for i in range(4)], dst) == 4
    holder.server.close()
    gone = client.fetch_outcome(holder.server.address, [key(i) for i in range(4)], dst)
    assert gone.count == 0 and gone.failed
    assert client.failures >= 1
    client.close()


def test_a_layout_mismatch_is_refused_and_delivers_nothing(backend: Backend, holder: Holder) -> None:
    other = KVLayout.of(kv_tensor(4, head_dim=64), FINGERPRINT)
    client = BlockClient(other, backend, timeout=5.0)
    dst = torch.zeros(1, BLOCK_BYTES, dtype=torch.uint8)
    assert client.fetch(holder.server.address, [key(0)], dst) == 0
    assert client.failures == 1 and not dst.any()
    client.close()


def test_the_shared_secret_is_checked(backend: Backend) -> None:
    holder = Holder(backend, random_blocks(1), secret=b"s3cret")
    try:
        dst = torch.zeros(1, BLOCK_BYTES, dtype=torch.uint8)
        assert client_for(backend, holder).fetch(holder.server.address, [key(0)], dst) == 0
        good = client_for(backend, holder, secret=b"s3cret")
        assert good.fetch(holder.server.address, [key(0)], dst) == 1
        good.close()
    finally:
        holder.server.close()
