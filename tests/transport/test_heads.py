"""KV between tensor-parallel layouts (transport/heads.py): the head plan, exhaustively, and real
transfers from a prefill worker of one layout to a decode worker of another over every backend."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from tests.waiting import poll
from halfmoon.transport import KVLayout, KVReceiver, KVSender
from halfmoon.transport.channel import Backend
from halfmoon.transport.errors import ChecksumError, HandshakeError
from halfmoon.transport.faults import FaultInjector
from halfmoon.transport.heads import check_layouts, head_plan, kv_head_range, num_sources

LAYERS, BLOCKS, BLOCK, HEAD_DIM = 3, 8, 16, 8
FP = "heads-test"


def valid(heads: int, tp: int) -> bool:
    return heads >= tp or tp % heads == 0


LAYOUTS = [(h, p, d) for h, p, d in itertools.product(range(1, 9), range(1, 9), range(1, 9))
           if valid(h, p) and valid(h, d)]


@pytest.mark.parametrize("heads,p,d", LAYOUTS)
def test_every_decode_rank_gets_exactly_its_heads_from_ranks_that_hold_them(heads: int, p: int, d: int) -> None:
    plan = head_plan(heads, p, d)
    pairs = [(x.src_rank, x.dst_rank) for x in plan]
    assert len(pairs) == len(set(pairs)), "at most one piece (one connection) per pair"
    for dst in range(d):
        d0, d1 = kv_head_range(heads, dst, d)
        got = sorted(h for x in plan if x.dst_rank == dst for h in range(x.start, x.start + x.count))
        assert got == list(range(d0, d1)), "its heads, each once, nothing else"
        assert num_sources(heads, p, d, dst) == sum(1 for x in plan if x.dst_rank == dst)
    for x in plan:
        s0, s1 = kv_head_range(heads, x.src_rank, p)
        d0, _ = kv_head_range(heads, x.dst_rank, d)
        assert s0 <= x.start and x.start + x.count <= s1, "the source holds what it sends"
        assert (x.src_offset, x.dst_offset) == (x.start - s0, x.start - d0)


def test_replicated_heads_spread_the_reads() -> None:
    """One KV head, 2 prefill ranks that both hold it, 2 decode ranks: each reads another replica."""
    assert [(x.src_rank, x.dst_rank) for x in head_plan(1, 2, 2)] == [(0, 0), (1, 1)]
    assert [(x.src_rank, x.dst_rank, x.count) for x in head_plan(3, 2, 1)] == [(0, 0, 2), (1, 0, 1)]
    assert [(x.src_rank, x.dst_rank, x.count) for x in head_plan(3, 1, 2)] == [(0, 0, 2), (0, 1, 1)]


# ---------------------------------------------------------------- transfers


class Worker:
    """One worker's ranks: each its own KV shard of `full`'s heads (zeros unless `full`)."""

    def __init__(self, heads: int, tp: int, full: torch.Tensor | None = None) -> None:
        self.shards: list[torch.Tensor] = []
        self.layouts: list[KVLayout] = []
        for rank in range(tp):
            a, b = kv_head_range(heads, rank, tp)
            t = (full[..., a:b, :].contiguous() if full is not None
                 else torch.zeros(LAYERS, 2, BLOCKS, BLOCK, b - a, HEAD_DIM))
            self.shards.append(t)
            self.layouts.append(KVLayout.of(t, FP, tp=tp, kv_head_start=a, rank=rank, model_kv_heads=heads))


def full_kv(heads: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(LAYERS, 2, BLOCKS, BLOCK, heads, HEAD_DIM, generator=torch.Generator().manual_seed(seed))


def transfer(backend: Backend, heads: int, p: int, d: int, src_ids: list[int], dst_ids: list[int],
             faults: FaultInjector | None = None) -> tuple[Worker, list[KVReceiver], list]:
    """Push layers of `src_ids` from a tp-p worker into `dst_ids` of a tp-d worker, one sender
    per (prefill rank, decode rank) pair; the receivers and every stream's outcome."""
    full = full_kv(heads)
    prefill, decode = Worker(heads, p, full), Worker(heads, d)
    receivers = [KVReceiver(t, lay, backend, timeout=5.0).start() for t, lay in zip(decode.shards, decode.layouts)]
    senders, outcomes = [], []
    try:
        for r in receivers:
            r.expect("req", dst_ids)
        for i, piece in enumerate(head_plan(heads, p, d)):  # `faults`: the first sender's
            sender = KVSender(prefill.shards[piece.src_rank], prefill.layouts[piece.src_rank], backend,
                              receivers[piece.dst_rank].address, timeout=5.0, faults=faults if i == 0 else None)
            senders.append(sender)
            stream = sender.open("req", dst_ids)
            for layer in range(LAYERS):
                stream.send_layer(layer, src_ids, dst_ids)
            stream.finish({"first_token": 7})
            outcomes.append(stream)
        for stream in outcomes:
            try:
                stream.wait(10)
            except ChecksumError as e:
                outcomes[outcomes.index(stream)] = e
    finally:
        for s in senders:
            s.close()
    decode.full = full  # type: ignore[attr-defined]
    return decode, receivers, outcomes


@pytest.mark.parametrize("heads,p,d", [(3, 2, 1), (3, 1, 2), (4, 2, 4), (2, 4, 1), (1, 1, 2), (1, 2, 1), (1, 2, 2)])
def test_a_transfer_between_layouts_lands_each_ranks_heads(backend: Backend, heads: int, p: int, d: int) -> None:
    src, dst = [5, 6, 7, 1], [0, 1, 2, 4]
    decode, receivers, _ = transfer(backend, heads, p, d, src, dst)
    try:
        full = decode.full  # type: ignore[attr-defined]
        per_head = LAYERS * len(src) * 2 * BLOCK * HEAD_DIM * 4
        for rank, r in enumerate(receivers):
            result = r.wait("req", 10)
            a, b = kv_head_range(heads, rank, d)
            assert torch.equal(decode.shards[rank][:, :, dst], full[:, :, src, :, a:b]), f"rank {rank}"
            untouched = [i for i in range(BLOCKS) if i not in dst]
            assert not decode.shards[rank][:, :, untouched].any(), "only the reserved blocks are written"
            assert result.meta == {"first_token": 7}
            assert r.stats.bytes == result.num_bytes == (b - a) * per_head, "this rank's heads' bytes, no more"
    finally:
        for r in receivers:
            r.close()


def test_a_corrupted_head_slice_fails_the_request_and_never_lands(backend: Backend) -> None:
    """A decode rank fed by two prefill ranks, one of whose units is corrupted: its checksum
    fails the transfer, and the staged slice is not scattered into the blocks."""
    faults = FaultInjector()
    faults.corrupt_next(times=1)
    decode, receivers, outcomes = transfer(backend, 3, 2, 1, [1, 2], [3, 4], faults)
    try:
        with pytest.raises(ChecksumError):
            receivers[0].wait("req", 10)
        assert any(isinstance(o, ChecksumError) for o in outcomes)
        assert receivers[0].stats.checksum_failures == 1
        layer0 = decode.shards[0][0, :, [3, 4], :, :2]
        assert not layer0.any(), "the corrupted unit (rank 0's heads, layer 0) was not written"
    finally:
        for r in receivers:
            r.close()


def test_the_handshake_carries_both_layouts_and_refuses_a_pair_without_heads(backend: Backend) -> None:
    decode = Worker(3, 2)
    prefill = Worker(3, 2, full_kv(3))
    receiver = KVReceiver(decode.shards[1], decode.layouts[1], backend, timeout=5.0).start()
    try:
        with pytest.raises(HandshakeError) as err:  # prefill rank 0 holds heads 0, 1; decode rank 1 takes head 2
            KVSender(prefill.shards[0], prefill.layouts[0], backend, receiver.address, timeout=5.0)
        assert err.value.field == "rank"
        assert poll(lambda: receiver.stats.refused == 1, 5.0)
        sender = KVSender(prefill.shards[1], prefill.layouts[1], backend, receiver.address, timeout=5.0)
        assert sender.peer_layout == decode.layouts[1] and sender.piece.count == 1
        sender.close()
        with pytest.raises(HandshakeError) as err:
            check_layouts(replace(prefill.layouts[1], kv_head_start=0), decode.layouts[1])
        assert err.value.field == "num_kv_heads"
    finally:
        receiver.close()
