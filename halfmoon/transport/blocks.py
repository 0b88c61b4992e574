"""Pulling whole KV blocks by hash from another worker: the transport under kvpool's remote reads.

A prefix the cluster index says another worker holds is fetched from that worker instead of
recomputed. Every worker runs a `BlockServer`; a worker that wants blocks asks it through a
`BlockClient` (one cached connection per server):

    server = BlockServer(serve, layout, backend, host="0.0.0.0").start()   # the holder
    client = BlockClient(layout, backend)                                   # the requester
    n = client.fetch(server.address, hashes, dst)    # dst: [len(hashes), block_bytes] uint8

`serve(hashes, rows)` copies the leading blocks of `hashes` the holder has into `rows` and
returns how many (kvpool.tiered.KVTiers.serve_blocks, run on the holder's engine thread).

Wire, on one channel of any backend, after the same handshake as a KV push (protocol version,
KV layout, shared secret):

    client -> FETCH  {"hashes": [hex, ...]}               at most FETCH_BATCH hashes
    server -> BLOCKS count=n, payload_len=n*block_bytes   then the payload frames and an xxh3-64
                                                          trailer, on the data lane
The client asks batch after batch until a batch comes back short. Payload lands straight in the
caller's rows; a batch whose checksum fails is not used (the blocks are recomputed), and any
failure (peer gone, timeout, refused handshake) delivers what was verified so far, never raises.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from halfmoon.transport.acceptor import Acceptor
from halfmoon.transport.channel import Backend, Channel
from halfmoon.transport.errors import ProtocolError, TransportError
from halfmoon.transport.faults import FaultInjector
from halfmoon.transport.layout import KVLayout
from halfmoon.transport.protocol import (
    Header,
    Kind,
    accept_handshake,
    json_body,
    message_frames,
    offer_handshake,
    parse_json,
    post_payload,
    receive_payload,
    recv_msg,
)

log = logging.getLogger("halfmoon.transport")
FETCH_BATCH = 32  # blocks per FETCH: bounds the server's staging memory (32 x block bytes)
ServeFn = Callable[[list[bytes], torch.Tensor], int]


class BlockServer:
    """Answers FETCH requests from any number of clients, one thread per connection."""

    def __init__(self, serve: ServeFn, layout: KVLayout, block_bytes: int, backend: Backend,
                 host: str = "127.0.0.1", port: int = 0, secret: bytes | None = None,
                 timeout: float = 30.0, faults: FaultInjector | None = None) -> None:
        self.serve, self.layout, self.block_bytes = serve, layout, block_bytes
        self.secret, self.timeout, self.faults = secret, timeout, faults
        self._served = 0
        self._served_lock = threading.Lock()  # one thread per connection adds to it
        self._acceptor = Acceptor(backend.listen(host, port), self._serve_channel, "kv-block-server")
        self.address = self._acceptor.address

    def start(self) -> BlockServer:
        self._acceptor.start()
        return self

    @property
    def served_blocks(self) -> int:
        """Blocks sent to clients since start (all connections)."""
        with self._served_lock:
            return self._served

    def close(self) -> None:
        self._acceptor.close()

    def _serve_channel(self, channel: Channel) -> None:
        try:
            accept_handshake(channel, self.layout, self.secret, self.timeout)
            while True:
                header, body = recv_msg(channel, None, self.timeout)
                if header.kind is not Kind.FETCH:
                    raise ProtocolError(f"unexpected {header.kind.name} from a block client")
                self._answer(channel, _parse_hashes(body))
        except TransportError as e:
            log.debug("block client %s: %s", channel.peer, e)

    def _answer(self, channel: Channel, hashes: list[bytes]) -> None:
        rows = torch.empty(len(hashes), self.block_bytes, dtype=torch.uint8, device="cpu")
        n = self.serve(hashes, rows) if hashes else 0
        views = [memoryview(rows[:n].numpy()).cast("B")] if n else []
        corrupt = bool(views) and self.faults is not None and self.faults.should_corrupt("fetch", 0)
        head = message_frames(Header(Kind.BLOCKS, count=n, payload_len=n * self.block_bytes), b"")
        finish = post_payload(channel, head, views, self.timeout, corrupt)
        if finish is not None:
            finish(self.timeout)
        with self._served_lock:
            self._served += n


class BlockClient:
    """Fetches blocks from block servers; one connection per server address, reused."""

    def __init__(self, layout: KVLayout, backend: Backend, secret: bytes | None = None,
                 timeout: float = 30.0) -> None:
        self.layout, self.backend, self.secret, self.timeout = layout, backend, secret, timeout
        self.fetched_blocks = 0
        self.checksum_failures = 0
        self.failures = 0
        self._channels: dict[str, Channel] = {}
        self._lock = threading.Lock()  # one fetch at a time per client (the engine thread's)

    def fetch(self, address: str, hashes: Sequence[bytes], dst: torch.Tensor) -> int:
        """The leading blocks of `hashes` that `address` holds, verified, in `dst` rows; the
        count. Never raises: a failure delivers the batches verified before it."""
        return self.fetch_outcome(address, hashes, dst).count

    def fetch_outcome(self, address: str, hashes: Sequence[bytes], dst: torch.Tensor) -> Fetched:
        """`fetch`, also telling whether it stopped on a failure (a lost connection, a protocol
        error or a checksum mismatch) rather than on a block `address` does not hold."""
        if dst.dtype != torch.uint8 or dst.dim() != 2 or not dst.is_contiguous() or len(dst) < len(hashes):
            raise ValueError(f"dst must be a contiguous [>= {len(hashes)}, block_bytes] uint8 tensor")
        got, failed = 0, False
        with self._lock:
            while got < len(hashes) and not failed:
                batch = list(hashes[got : got + FETCH_BATCH])
                n, failed = self._fetch_batch(address, batch, dst[got : got + len(batch)])
                got += n
                if n < len(batch):
                    break
        self.fetched_blocks += got
        return Fetched(got, failed)

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()

    def _fetch_batch(self, address: str, hashes: list[bytes], rows: torch.Tensor) -> tuple[int, bool]:
        """(blocks delivered, whether the batch failed)."""
        try:
            channel = self._channel(address)
            channel.send_many(message_frames(Header(Kind.FETCH), _hashes_body(hashes)), self.timeout)
            n = self._receive(channel, rows, len(hashes))
        except TransportError as e:
            self.failures += 1
            log.warning("fetching %d blocks from %s failed (they are recomputed): %s", len(hashes), address, e)
            self._drop(address)
            return 0, True
        return (0, True) if n is None else (n, False)

    def _channel(self, address: str) -> Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self.backend.connect(address, self.timeout)
            try:
                offer_handshake(channel, self.layout, self.secret, self.timeout)
            except BaseException:
                channel.close()
                raise
            self._channels[address] = channel
        return channel

    def _drop(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is not None:
            channel.close()

    def _receive(self, channel: Channel, rows: torch.Tensor, asked: int) -> int | None:
        """The blocks delivered, None when they failed their checksum."""
        header, _ = recv_msg(channel, self.timeout, self.timeout)
        n = header.count
        if header.kind is not Kind.BLOCKS or n > asked or header.payload_len != n * rows.shape[1]:
            raise ProtocolError(f"expected BLOCKS of <= {asked} blocks, got {header.kind.name} "
                                f"count={n} payload={header.payload_len}")
        views = [memoryview(rows[:n].numpy()).cast("B")] if n else []
        actual, expected = receive_payload(channel, views, self.timeout)
        if actual != expected:
            self.checksum_failures += 1
            log.error("%d blocks fetched from %s failed their checksum; not used", n, channel.peer)
            return None
        return n


@dataclass(frozen=True, slots=True)
class Fetched:
    """What `BlockClient.fetch_outcome` delivered."""

    count: int  # leading blocks delivered and verified
    failed: bool  # it stopped on a failure, not on a block the holder lacks


def _hashes_body(hashes: Sequence[bytes]) -> bytes:
    return json_body({"hashes": [h.hex() for h in hashes]})


def _parse_hashes(body: bytes) -> list[bytes]:
    raw = parse_json(body).get("hashes")
    if not isinstance(raw, list) or len(raw) > FETCH_BATCH:
        raise ProtocolError(f"FETCH carries no list of at most {FETCH_BATCH} hashes")
    try:
        return [bytes.fromhex(h) for h in raw]
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"FETCH carries a malformed hash: {e}") from e


__all__ = ["FETCH_BATCH", "BlockClient", "BlockServer", "Fetched"]
