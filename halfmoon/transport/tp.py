"""A tensor-parallel worker's KV endpoints: one per rank, each over that rank's KV shard.

    prefill worker, tp p                       decode worker, tp d
    RankPeers: a KVPeers per rank              RankReceivers: a KVReceiver per rank
      open(addresses, ...) -> RankPushStream     addresses (rank 0's first) go in the KVHandoff
        one PushStream per (src, dst) pair  -->  each rank's receiver gets its heads only
        of `heads.destinations(H, p, d)`          (`wait` returns once every rank's is in)

The verbs are a single endpoint's (`PushStream`, `KVReceiver`), so the workers and the engine
treat a tp=1 worker (one rank, one pair) and a tp=N worker alike. Every rank's endpoint lives in
the worker's process (rank 0's, the Ray actor): the ranks' KV caches are shared memory that rank 0
maps (engine/tp_ranks.py), and a rank only touches its cache inside the steps rank 0 runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from halfmoon.transport.config import TransportConfig
from halfmoon.transport.errors import TransportError
from halfmoon.transport.faults import FaultInjector
from halfmoon.transport.heads import destinations
from halfmoon.transport.layout import KVLayout
from halfmoon.transport.peers import KVPeers
from halfmoon.transport.receiver import KVReceiver, TransferResult
from halfmoon.transport.sender import PushStream, SentUnit

Shard = tuple[torch.Tensor, KVLayout]  # a rank's KV cache and its layout


class RankPushStream:
    """One request's push from every rank of a prefill worker to every rank of a decode
    worker: a `PushStream` per (source rank, destination rank) pair, driven as one."""

    def __init__(self, streams: Sequence[PushStream], dst_block_ids: Sequence[int]) -> None:
        self.streams = list(streams)
        self.dst_block_ids = list(dst_block_ids)

    def send_layer(self, layer: int, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Queue layer `layer` on every pair (each moves its heads of the same blocks)."""
        for stream in self.streams:
            stream.send_layer(layer, src_ids, dst_ids)

    def finish(self, meta: dict | None = None) -> None:
        for stream in self.streams:
            stream.finish(meta)

    def cancel(self) -> None:
        for stream in self.streams:
            stream.cancel()

    def flush(self, timeout: float | None = None) -> None:
        for stream in self.streams:
            stream.flush(timeout)

    def wait(self, timeout: float) -> None:
        """Every pair confirmed by its receiver (the first failure raised), within `timeout`."""
        deadline = time.monotonic() + timeout
        for stream in self.streams:
            stream.wait(max(0.0, deadline - time.monotonic()))

    @property
    def sent(self) -> bool:
        return all(s.sent for s in self.streams)

    @property
    def done(self) -> bool:
        return all(s.done for s in self.streams)

    @property
    def error(self) -> TransportError | None:
        return next((s.error for s in self.streams if s.error is not None), None)

    @property
    def log(self) -> list[SentUnit] | None:
        """The first pair's units as queued (tracing: the prefill's chunks, one pair's bytes)."""
        return self.streams[0].log

    @property
    def num_bytes(self) -> int:
        """Bytes queued on every pair so far."""
        return sum(s.bytes_submitted for s in self.streams)


class RankPeers:
    """A prefill worker's senders: per rank a `KVPeers` over that rank's KV shard."""

    def __init__(self, shards: Sequence[Shard], config: TransportConfig,
                 faults: FaultInjector | None = None) -> None:
        backend = config.make_backend()
        self.peers = [KVPeers(kv, layout, config, backend, faults) for kv, layout in shards]
        self.layout = shards[0][1]

    def open(self, addresses: Sequence[str], request_id: str, dst_block_ids: Sequence[int],
             traceparent: str | None = None, record: bool = False) -> RankPushStream:
        """Connect (or reuse) every pair to the decode worker whose ranks listen at `addresses`
        (rank 0's first) and open the request's stream on each; blocking (connects)."""
        pairs = destinations(self.layout.total_kv_heads, len(self.peers), len(addresses))
        streams: list[PushStream] = []
        try:
            for src, dst in pairs:
                sender = self.peers[src].sender(addresses[dst])
                streams.append(sender.open(request_id, dst_block_ids, traceparent, record))
        except BaseException:
            for stream in streams:
                stream.cancel()
            raise
        return RankPushStream(streams, dst_block_ids)

    @property
    def reconnects(self) -> int:
        return sum(p.reconnects for p in self.peers)

    def close(self) -> int:
        """Close every rank's connections; how many were open."""
        return sum(p.close() for p in self.peers)


class RankReceivers:
    """A decode worker's receivers: one per rank over its KV shard, each on its own port."""

    def __init__(self, shards: Sequence[Shard], config: TransportConfig) -> None:
        """Rank r listens on `config.port + r` (any free port when it is 0)."""
        backend = config.make_backend()
        self.receivers: list[KVReceiver] = []
        try:
            for rank, (kv, layout) in enumerate(shards):
                port = config.port + rank if config.port else 0
                self.receivers.append(KVReceiver(kv, layout, backend, host=config.host, port=port,
                                                 secret=config.secret(), timeout=config.timeout_s,
                                                 inflight_bytes=config.max_inflight_bytes).start())
        except BaseException:
            self.close()
            raise

    @property
    def addresses(self) -> list[str]:
        """Every rank's receiver, rank 0's first."""
        return [r.address for r in self.receivers]

    @property
    def rank_bytes(self) -> list[int]:
        """KV bytes each rank received (verified), rank 0's first."""
        return [r.stats.bytes for r in self.receivers]

    def path_bytes(self, path: str) -> int:
        """KV bytes every rank received (verified) from senders on transfer path `path`
        (transport/staging.py: host, staged)."""
        return sum(r.stats.bytes_by_path.get(path, 0) for r in self.receivers)

    def expect(self, request_id: str, block_ids: list[int], record: bool = False) -> None:
        done: list[KVReceiver] = []
        try:
            for r in self.receivers:
                r.expect(request_id, block_ids, record)
                done.append(r)
        except BaseException:
            for r in done:
                r.cancel(request_id)
            raise

    def wait(self, request_id: str, timeout: float) -> TransferResult:
        """Every rank's transfer in and verified (rank 0's result, with every rank's units and
        bytes counted); the first rank's error raised, the others cancelled."""
        deadline = time.monotonic() + timeout
        results: list[TransferResult] = []
        try:
            for r in self.receivers:
                results.append(r.wait(request_id, max(0.0, deadline - time.monotonic())))
        except BaseException:
            self.cancel(request_id)
            raise
        first = results[0]
        return replace(first, num_units=sum(x.num_units for x in results), num_bytes=sum(x.num_bytes for x in results))

    def cancel(self, request_id: str) -> None:
        for r in self.receivers:
            r.cancel(request_id)

    def pending(self) -> list[str]:
        """Requests some rank still expects."""
        return sorted({rid for r in self.receivers for rid in r.pending()})

    def close(self) -> None:
        for r in self.receivers:
            r.close()
