"""The prefill side of a KV transfer: one connection to one receiver, a sender thread that
streams transfer units straight from the local KV tensor, and a bound on in-flight bytes.

    sender = KVSender(kv_cache, layout, backend, receiver_address)   # connect + handshake
    stream = sender.open("r1", dst_block_ids)    # (traceparent=..., record=True: see PushStream)
    stream.send_layer(layer, src_ids, dst_ids)  # returns at once (blocks only on backpressure)
    stream.finish({"first_token": 42})          # after the last unit
    stream.wait(timeout=30)                      # the receiver verified everything, or raises

Between tensor-parallel layouts (transport/heads.py) one sender connects one prefill rank's KV
to one decode rank's receiver and moves the heads the handshake's plan gives the pair
(`piece`); its DONE tells the receiver how many source ranks feed it (`sources`).

`send_layer` only queues: the bytes are read from the KV tensor by the sender thread, so the
caller must not overwrite those blocks until `stream.wait()` (or `stream.flush()`) returns.
Queued + sending bytes never exceed `max_inflight_bytes`: a slow receiver makes `send_layer`
wait (up to the timeout), never grows memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from halfmoon.transport.channel import Backend
from halfmoon.transport.errors import (
    ChecksumError,
    HandshakeError,
    PeerLostError,
    ProtocolError,
    TransferCancelledError,
    TransferTimeoutError,
    TransportError,
)
from halfmoon.transport.faults import FaultInjector
from halfmoon.transport.heads import check_layouts, num_sources, sender_heads
from halfmoon.transport.layout import KVBytes, KVLayout, KVShape
from halfmoon.transport.staging import HOST, STAGED, Slot, Stager
from halfmoon.transport.protocol import (
    Header,
    Kind,
    json_body,
    message_frames,
    offer_handshake,
    parse_json,
    post_payload,
    recv_msg,
    send_json,
    unit_body,
    unit_frame_lengths,
)

log = logging.getLogger("halfmoon.transport")
MAX_POSTED_JOBS = 8  # jobs whose sends may be on the wire at once (per connection)


@dataclass(slots=True)
class SenderStats:
    units: int = 0
    bytes: int = 0
    peak_inflight_bytes: int = 0


class SentUnit(NamedTuple):
    """A unit as the caller queued it (`PushStream.log`): wall-clock ns, layer, blocks, bytes."""

    at_ns: int
    layer: int
    blocks: int
    nbytes: int


@dataclass(slots=True, eq=False)
class _Job:
    kind: Kind  # UNIT, DONE or CANCEL
    stream: PushStream
    layer: int = 0
    src: Sequence[int] = ()
    dst: Sequence[int] = ()
    nbytes: int = 0
    meta: dict | None = None
    count: int = 0
    slot: Slot | None = None  # the staged copy of a unit from device memory (transport/staging.py)


class PushStream:
    """One request's transfer to the sender's peer. `traceparent` (the request's span on this
    side, W3C) travels in the DONE message to the receiver's `TransferResult`; `log`, when
    recording, lists every unit as `send_layer` queued it (tracing: the prefill's chunks)."""

    def __init__(self, sender: KVSender, request_id: str, dst_block_ids: Sequence[int],
                 traceparent: str | None = None, record: bool = False) -> None:
        self.sender = sender
        self.request_id = request_id
        self.dst_block_ids = list(dst_block_ids)
        self.traceparent = traceparent
        self.log: list[SentUnit] | None = [] if record else None
        self.units_submitted = 0
        self.units_sent = 0
        self.finished = False
        self.cancelled = False
        self.error: TransportError | None = None
        self._done = threading.Event()

    def send_layer(self, layer: int, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Queue layer `layer` of blocks `src_ids` (local) for blocks `dst_ids` (the peer's)."""
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
        if not src_ids:
            return
        self._check_open()
        stager = self.sender.stager
        if stager is None:
            self._submit_unit(layer, src_ids, dst_ids, None)
            return
        # from device memory: one unit per staging slot, each copy queued behind this layer's compute
        for start in range(0, len(src_ids), stager.slot_blocks):
            src = src_ids[start : start + stager.slot_blocks]
            slot = stager.stage(layer, src, self.sender.timeout)
            self._submit_unit(layer, src, dst_ids[start : start + stager.slot_blocks], slot)

    def _submit_unit(self, layer: int, src_ids: Sequence[int], dst_ids: Sequence[int], slot: Slot | None) -> None:
        nbytes = self.sender.kv.unit_bytes(len(src_ids))
        try:
            self.sender._submit(_Job(Kind.UNIT, self, layer, list(src_ids), list(dst_ids), nbytes, slot=slot))
        except BaseException:
            if slot is not None:
                self.sender.stager.ring.release(slot)  # type: ignore[union-attr]
            raise
        self.units_submitted += 1
        if self.log is not None:
            self.log.append(SentUnit(time.time_ns(), layer, len(src_ids), nbytes))

    def finish(self, meta: dict | None = None) -> None:
        """No more units; `meta` (JSON-able) reaches the receiver's `wait()` result."""
        self._check_open()
        self.finished = True
        self.sender._submit(_Job(Kind.DONE, self, meta=meta or {}, count=self.units_submitted))

    def cancel(self) -> None:
        """Drop queued units and tell the receiver; `wait()` then raises TransferCancelledError."""
        if self._done.is_set():
            return
        self.cancelled = True
        self.sender._cancel(self)

    def flush(self, timeout: float | None = None) -> None:
        """Block until every queued unit has left (its source blocks may be reused); `timeout`
        defaults to the sender's."""
        self.sender._flush(self, self.sender.timeout if timeout is None else timeout)

    def wait(self, timeout: float) -> None:
        """Block until the receiver confirmed (raises its error, or TransferTimeoutError)."""
        if not self._done.wait(timeout):
            raise TransferTimeoutError(f"request {self.request_id!r}: no confirmation from "
                                       f"{self.sender.address} within {timeout:.1f}s")
        if self.error is not None:
            raise self.error

    @property
    def done(self) -> bool:
        """The receiver answered (or the stream failed or was cancelled)."""
        return self._done.is_set()

    @property
    def sent(self) -> bool:
        """No unit of this stream is queued or being sent: its source blocks may be reused."""
        return self.sender._all_sent(self)

    def _check_open(self) -> None:
        if self.error is not None:
            raise self.error
        if self.finished or self.cancelled:
            raise ProtocolError(f"request {self.request_id!r}: the stream is already finished or cancelled")

    def _resolve(self, error: TransportError | None) -> None:
        if not self._done.is_set():
            self.error = error
            self._done.set()


class KVSender:
    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, backend: Backend, address: str,
                 secret: bytes | None = None, timeout: float = 30.0,
                 max_inflight_bytes: int = 256 << 20, faults: FaultInjector | None = None,
                 stager: Stager | None = None) -> None:
        """Connects and handshakes at once (raises HandshakeError naming the differing field).
        A KV tensor on a GPU is sent through pinned staging slots (transport/staging.py; `stager`
        overrides the ring a CUDA tensor gets, e.g. the host copier in the CPU tests)."""
        if stager is None and kv_cache.device.type != "cpu":
            stager = Stager.for_device(kv_cache, max_inflight_bytes)
        self.stager = stager
        self.path = HOST if stager is None else STAGED
        self.kv: KVShape = KVBytes(kv_cache) if stager is None else KVShape(kv_cache)
        self.layout = layout
        self.address = address
        self.timeout = timeout
        self.max_inflight_bytes = max_inflight_bytes
        self.faults = faults
        self.stats = SenderStats()
        self.kv_cache = kv_cache
        self.channel = backend.connect(address, timeout)
        try:
            self._handshake(secret)
        except BaseException:
            self.channel.close()
            raise
        self._jobs: deque[_Job] = deque()
        self._streams: dict[str, PushStream] = {}
        self._inflight = 0
        self._cond = threading.Condition()
        self._broken: TransportError | None = None
        self._closing = False
        self._current: _Job | None = None  # the job the sender thread is posting
        # Posted jobs whose sends may still be on the wire, oldest first, with their waits.
        self._posted: deque[tuple[_Job, Callable[[float], None] | None]] = deque()
        self._threads = [threading.Thread(target=fn, name=f"kv-sender-{name}", daemon=True)
                         for fn, name in ((self._send_loop, "send"), (self._result_loop, "results"))]
        for t in self._threads:
            t.start()

    def _handshake(self, secret: bytes | None) -> None:
        """Agree on the layouts: which of this rank's heads go to the receiver's rank, and how;
        the HELLO names this side's transfer path (host, staged)."""
        peer = offer_handshake(self.channel, self.layout, secret, self.timeout, self.path)
        self.peer_layout = peer
        self.piece = check_layouts(self.layout, peer)
        heads = sender_heads(self.piece)
        if self.stager is None:
            self.kv = KVBytes(self.kv_cache, heads)
        else:
            self.kv = KVShape(self.kv_cache, heads)
            if self.kv.staged:
                raise HandshakeError("tp", "a device KV tensor sends whole slabs only: a head slice of its "
                                     "blocks is not supported on the staged path")
        self.dst_staged = self.piece.count != peer.num_kv_heads  # the receiver scatters a head slice
        self.sources = num_sources(peer.total_kv_heads, self.layout.tp, peer.tp, peer.rank)

    # ------------------------------------------------------------------ the caller's verbs

    def open(self, request_id: str, dst_block_ids: Sequence[int], traceparent: str | None = None,
             record: bool = False) -> PushStream:
        """A stream for one request (`traceparent`, `record`: see PushStream)."""
        with self._cond:
            if self._broken is not None:
                raise self._broken
            if request_id in self._streams:
                raise ProtocolError(f"request {request_id!r} already has an open stream")
            stream = PushStream(self, request_id, dst_block_ids, traceparent, record)
            self._streams[request_id] = stream
        return stream

    @property
    def inflight_bytes(self) -> int:
        return self._inflight

    @property
    def broken(self) -> TransportError | None:
        return self._broken

    def close(self) -> None:
        with self._cond:
            self._closing = True
            if self._broken is None:  # later sends and opens fail at once
                self._broken = PeerLostError(f"sender to {self.address} was closed")
            self._cond.notify_all()
        self.channel.close()  # no send touches memory once this returned
        for t in self._threads:
            t.join(timeout=5)
        with self._cond:  # what was queued or on the wire is gone: its blocks are free again
            self._inflight -= sum(j.nbytes for j in self._jobs) + sum(j.nbytes for j, _ in self._posted)
            self._free_slots([*self._jobs, *(j for j, _ in self._posted)])
            self._jobs.clear()
            self._posted.clear()
            self._current = None
            self._cond.notify_all()
        if self.stager is not None:
            self.stager.close()
        self._fail_all(PeerLostError(f"sender to {self.address} was closed"))

    # ------------------------------------------------------------------ queue

    def _submit(self, job: _Job) -> None:
        """Queue a job; waits (up to the timeout) while the in-flight budget is used up."""
        with self._cond:
            fits = lambda: (self._broken is not None or self._inflight == 0  # noqa: E731
                            or self._inflight + job.nbytes <= self.max_inflight_bytes)
            if not self._cond.wait_for(fits, self.timeout):
                raise TransferTimeoutError(
                    f"backpressure: {self._inflight} bytes still in flight to {self.address} "
                    f"after {self.timeout:.1f}s (the receiver is not keeping up)")
            if self._broken is not None:
                raise self._broken
            self._inflight += job.nbytes
            self.stats.peak_inflight_bytes = max(self.stats.peak_inflight_bytes, self._inflight)
            self._jobs.append(job)
            self._cond.notify_all()

    def _cancel(self, stream: PushStream) -> None:
        with self._cond:
            dropped = [j for j in self._jobs if j.stream is stream]
            for job in dropped:
                self._jobs.remove(job)
                self._inflight -= job.nbytes
            self._free_slots(dropped)
            if self._broken is None:  # a broken or closed connection has nobody to tell
                self._jobs.append(_Job(Kind.CANCEL, stream))
            self._cond.notify_all()
        stream._resolve(TransferCancelledError(f"request {stream.request_id!r} was cancelled by the sender"))

    def _all_sent(self, stream: PushStream) -> bool:
        with self._cond:
            return self._unsent(stream) == 0

    def _unsent(self, stream: PushStream) -> int:
        """Units of `stream` queued or being sent (caller holds the lock)."""
        # The current and posted jobs count even when broken: their sends may still be reading.
        current = self._current
        sending = int(current is not None and current.stream is stream and current.kind is Kind.UNIT)
        posted = sum(1 for j, _ in self._posted if j.stream is stream and j.kind is Kind.UNIT)
        return sending + posted + sum(1 for j in self._jobs if j.stream is stream and j.kind is Kind.UNIT)

    def _flush(self, stream: PushStream, timeout: float) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._unsent(stream) == 0, timeout):
                raise TransferTimeoutError(f"request {stream.request_id!r}: units still queued after {timeout:.1f}s")

    # ------------------------------------------------------------------ sender thread

    def _send_loop(self) -> None:
        """Post jobs as they come; a job is retired (its bytes released, its blocks free to
        reuse) once its sends completed — up to MAX_POSTED_JOBS stay posted, so the next unit
        goes out while the previous one is still on the wire."""
        while True:
            with self._cond:
                if not self._jobs and self._posted:
                    job = None  # nothing new: retire what is on the wire
                else:
                    self._cond.wait_for(lambda: self._jobs or self._closing or self._broken is not None)
                    if self._closing or self._broken is not None:
                        return
                    job = self._current = self._jobs.popleft()
            try:
                if job is None or len(self._posted) >= MAX_POSTED_JOBS:
                    self._retire()
                if job is not None:
                    finish = self._send(job)
                    with self._cond:
                        self._posted.append((job, finish))
            except TransportError as e:
                self._break(e)
                return
            finally:
                with self._cond:
                    self._current = None

    def _retire(self) -> None:
        with self._cond:
            if not self._posted:
                return  # cleared by _break
            job, finish = self._posted[0]
        if finish is not None:
            finish(self.timeout)
        with self._cond:
            if not self._posted or self._posted[0][0] is not job:
                return
            self._posted.popleft()
            self._inflight -= job.nbytes
            self._free_slots([job])  # its send completed: the slot may be staged again
            if job.kind is Kind.UNIT:
                job.stream.units_sent += 1
            self._cond.notify_all()

    def _send(self, job: _Job) -> Callable[[float], None] | None:
        stream = job.stream
        if job.kind is Kind.UNIT:
            return self._send_unit(job)
        if job.kind is Kind.DONE:
            done = {"request_id": stream.request_id, "meta": job.meta, "sources": self.sources}
            if stream.traceparent is not None:
                done["traceparent"] = stream.traceparent
            body = json_body(done)
            return self.channel.post_many(message_frames(Header(Kind.DONE, count=job.count), body), self.timeout)
        send_json(self.channel, Kind.CANCEL, {"request_id": stream.request_id}, self.timeout)
        with self._cond:
            self._streams.pop(stream.request_id, None)
        return None

    def _send_unit(self, job: _Job) -> Callable[[float], None] | None:
        """Header + body, then the payload frames and the hash trailer as one batch, so a message
        backend keeps frames in flight while the next ones are hashed."""
        views = self._unit_views(job)
        corrupt = self.faults is not None and self.faults.should_corrupt(job.stream.request_id, job.layer)
        lengths = unit_frame_lengths(self.kv, job.src, job.dst, job.nbytes, self.dst_staged)
        header = Header(Kind.UNIT, layer=job.layer, num_blocks=len(job.dst), payload_len=job.nbytes,
                        count=len(lengths))
        head = message_frames(header, unit_body(job.stream.request_id, job.dst, lengths))
        finish = post_payload(self.channel, head, views, self.timeout, corrupt, lengths)
        self.stats.units += 1
        self.stats.bytes += job.nbytes
        return finish

    def _unit_views(self, job: _Job) -> list[memoryview]:
        """The unit's bytes: views of the KV tensor, or of its staging slot once copied."""
        if job.slot is None:
            return self.kv.read_views(job.layer, job.src)  # type: ignore[attr-defined]
        if not job.slot.event.wait(self.timeout):  # type: ignore[union-attr]
            raise TransferTimeoutError(f"staging copy of layer {job.layer} not done after {self.timeout:.1f}s")
        return [job.slot.view()]

    # ------------------------------------------------------------------ results thread

    def _result_loop(self) -> None:
        try:
            while True:
                header, body = recv_msg(self.channel, None, self.timeout)
                if header.kind is not Kind.RESULT:
                    raise ProtocolError(f"unexpected {header.kind.name} from the receiver")
                self._on_result(parse_json(body))
        except TransportError as e:
            self._break(e)

    def _on_result(self, msg: dict) -> None:
        with self._cond:
            stream = self._streams.pop(str(msg.get("request_id")), None)
        if stream is not None:
            stream._resolve(None if msg.get("ok") else _remote_error(stream.request_id, msg.get("error") or {}))

    def _break(self, error: TransportError) -> None:
        with self._cond:
            if self._closing or self._broken is not None:
                return
            if not isinstance(error, (PeerLostError, TransferTimeoutError)):
                error = PeerLostError(f"connection to {self.address} failed: {error}")
            self._broken = error
            self._inflight -= sum(j.nbytes for j in self._jobs)
            self._free_slots(self._jobs)
            self._jobs.clear()
            self._cond.notify_all()
        log.warning("KV sender to %s broke: %s", self.address, error)
        self.channel.close()  # returns once no send of the channel can touch memory any more
        with self._cond:
            self._inflight -= sum(j.nbytes for j, _ in self._posted)
            self._free_slots([j for j, _ in self._posted])
            self._posted.clear()
            self._cond.notify_all()
        self._fail_all(error)

    def _free_slots(self, jobs: Sequence[_Job]) -> None:
        """Give back the staging slots of jobs no send reads any more (caller holds the lock)."""
        for job in jobs:
            if job.slot is not None:
                self.stager.ring.release(job.slot)  # type: ignore[union-attr]
                job.slot = None

    def _fail_all(self, error: TransportError) -> None:
        with self._cond:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            stream._resolve(error)


def _remote_error(request_id: str, err: dict) -> TransportError:
    kind, message = err.get("type"), str(err.get("message"))
    if kind == "ChecksumError":
        return ChecksumError(request_id, int(err.get("layer", -1)), int(err.get("expected", 0)),
                             int(err.get("actual", 0)))
    if kind == "TransferCancelledError":
        return TransferCancelledError(message)
    if kind == "PeerLostError":
        return PeerLostError(message)
    return ProtocolError(f"the receiver failed the transfer: {message}")
