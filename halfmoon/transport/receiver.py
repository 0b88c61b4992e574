"""The decode side of a KV transfer: listens, checks each sender's handshake, receives transfer
units straight into the reserved blocks of the local KV tensor, verifies their checksums, and
tells `wait()` when a request's transfer is complete.

    receiver = KVReceiver(kv_cache, layout, get_backend("tcp")).start()
    receiver.expect("r1", reserved_block_ids)     # before the sender starts pushing (record=True:
                                                  # every verified unit in the result, for tracing)
    result = receiver.wait("r1", timeout=30)      # every unit in and verified, or an exception

Between tensor-parallel layouts (transport/heads.py) a receiver is one decode rank's: each
accepted sender (a prefill rank) moves the heads the handshake's plan gives the pair, straight
into whole slabs or, for a head slice of them, through a staging buffer scattered into the blocks
once its checksum verified. A request is complete when every source rank feeding this rank (the
DONE says how many) sent its DONE with all its units in; `stats.bytes` counts this rank's bytes.

Invariant: once `wait()` or `cancel()` has returned, no byte for that request will be written to
the KV tensor again, so the caller may free (or use) the blocks. Units of unknown, cancelled or
failed requests are drained into a scratch buffer, never into the KV tensor. A unit that fails its
checksum fails the request: its blocks are freed by the caller, never joined to a batch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from halfmoon.transport.acceptor import Acceptor
from halfmoon.transport.channel import Backend, Channel
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
from halfmoon.transport.heads import check_layouts, receiver_heads
from halfmoon.transport.layout import KVBytes, KVLayout, KVShape
from halfmoon.transport.staging import HOST, Slot, Stager
from halfmoon.transport.protocol import (
    FRAME_BYTES,
    TRAILER,
    Header,
    Kind,
    PayloadReceipt,
    accept_handshake,
    json_body,
    message_frames,
    parse_json,
    parse_unit_body,
    receive_payload,
    recv_msg,
)

log = logging.getLogger("halfmoon.transport")
_OUTCOMES_KEPT = 1024
# Messages a posting receiver (transport.channel.Channel.posted_recv) reads ahead of the one it
# verifies: bounds the payload receives posted at once (and so the staging memory).
PIPELINE_DEPTH = 4


class UnitRecord(NamedTuple):
    """A verified unit (a receiver that records): when it was verified (wall-clock ns), its
    layer, blocks, bytes and xxh3-64 checksum."""

    at_ns: int
    layer: int
    blocks: int
    nbytes: int
    checksum: int


@dataclass(slots=True)
class TransferResult:
    request_id: str
    meta: dict  # what the sender attached to DONE (e.g. the first token)
    num_units: int
    num_bytes: int
    traceparent: str | None = None  # the sender's span of this request (W3C), if it sent one
    units: tuple[UnitRecord, ...] = ()  # every unit, in order, when `expect` asked to record
    first_unit_ns: int = 0  # when its first unit started to arrive (recorded; 0 = not recorded)


@dataclass(slots=True)
class ReceiverStats:
    units: int = 0
    bytes: int = 0
    checksum_failures: int = 0
    refused: int = 0  # handshakes refused
    peers_lost: int = 0
    # verified payload bytes by the senders' transfer path (transport/staging.py: host, staged)
    bytes_by_path: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class _Expected:
    request_id: str
    blocks: frozenset[int]
    state: str = "pending"  # pending -> done | failed
    error: TransportError | None = None
    busy: int = 0  # units being written into our blocks right now
    channels: set[Channel] = field(default_factory=set)  # the senders feeding it
    units: int = 0
    src_units: dict[int, int] = field(default_factory=dict)  # verified units by source rank
    done_srcs: set[int] = field(default_factory=set)  # source ranks whose DONE checked out
    bytes: int = 0
    meta: dict = field(default_factory=dict)
    log: list[UnitRecord] | None = None  # recording: the verified units
    first_ns: int = 0
    traceparent: str | None = None


@dataclass(frozen=True, slots=True, eq=False)
class _Link:
    """One accepted sender: its channel, the view of this rank's KV its heads land in (whole
    slabs, or a head slice: `KVBytes.staged`) and its tensor-parallel rank."""

    channel: Channel
    kv: KVShape
    src_rank: int
    path: str = HOST  # the sender's transfer path (transport/staging.py), from its HELLO


class KVReceiver:
    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, backend: Backend,
                 host: str = "127.0.0.1", port: int = 0, secret: bytes | None = None,
                 timeout: float = 30.0, faults: FaultInjector | None = None,
                 stager: Stager | None = None, inflight_bytes: int = 256 << 20) -> None:
        """`timeout` bounds every wait inside a message (handshake, body, payload frames).
        A KV tensor on a GPU receives each unit into a pinned staging slot, then copies it to
        its blocks (transport/staging.py); `stager` overrides that ring (the CPU tests).
        `inflight_bytes`: the senders' in-flight bound (--kv-max-inflight-mb): the slots are cut
        from it as the senders cut theirs, so every staged unit fits one."""
        if stager is None and kv_cache.device.type != "cpu":
            stager = Stager.for_device(kv_cache, inflight_bytes)
        self.stager = stager
        self.tensor = kv_cache
        self.kv: KVShape = KVBytes(kv_cache) if stager is None else KVShape(kv_cache)
        self.layout = layout
        self.backend = backend
        self.secret = secret
        self.timeout = timeout
        self.stats = ReceiverStats()
        self.faults = faults
        self._acceptor = Acceptor(backend.listen(host, port), self._serve, "kv-receiver")
        self.address = self._acceptor.address
        self._expected: dict[str, _Expected] = {}
        self._outcomes: OrderedDict[str, _Expected] = OrderedDict()  # recently forgotten requests
        self._cond = threading.Condition()
        self._closed = False
        self._drain_buf = memoryview(bytearray(min(FRAME_BYTES, 1 << 20)))

    def start(self) -> KVReceiver:
        self._acceptor.start()
        return self

    # ------------------------------------------------------------------ the caller's verbs

    def expect(self, request_id: str, block_ids: list[int], record: bool = False) -> None:
        """Allow units of `request_id` to write into `block_ids` (and nowhere else); `record`:
        list every verified unit in its `TransferResult` (tracing)."""
        self.kv.check(0, block_ids)
        with self._cond:
            if request_id in self._expected:
                raise ProtocolError(f"request {request_id!r} is already expected")
            self._expected[request_id] = _Expected(request_id, frozenset(block_ids),
                                                   log=[] if record else None)

    def wait(self, request_id: str, timeout: float) -> TransferResult:
        """Block until every unit of the request arrived and verified; raises the transfer's
        error (ChecksumError, PeerLostError, TransferCancelledError, ProtocolError) or
        TransferTimeoutError. Either way the request is forgotten and its blocks are the
        caller's again."""
        with self._cond:
            exp = self._get(request_id)
            if not self._cond.wait_for(lambda: exp.state != "pending", timeout):
                self._fail(exp, TransferTimeoutError(
                    f"request {request_id!r}: transfer incomplete after {timeout:.1f}s ({exp.units} units in)"))
            self._forget(exp)
        if exp.error is not None:
            raise exp.error
        return TransferResult(request_id, exp.meta, exp.units, exp.bytes, exp.traceparent,
                              tuple(exp.log or ()), exp.first_ns)

    def cancel(self, request_id: str) -> None:
        """Stop accepting units for the request; returns once none is being written."""
        with self._cond:
            exp = self._expected.get(request_id)
            if exp is None:
                return
            self._fail(exp, TransferCancelledError(f"request {request_id!r} was cancelled by the receiver"))
            self._forget(exp)

    def pending(self) -> list[str]:
        with self._cond:
            return sorted(self._expected)

    def close(self) -> None:
        with self._cond:
            self._closed = True
        self._acceptor.close(join_s=5.0)

    # ------------------------------------------------------------------ bookkeeping (lock held)

    def _get(self, request_id: str) -> _Expected:
        exp = self._expected.get(request_id)
        if exp is None:
            raise ProtocolError(f"request {request_id!r} is not expected here")
        return exp

    def _fail(self, exp: _Expected, error: TransportError) -> None:
        if exp.state == "pending":
            exp.state, exp.error = "failed", error
            self._cond.notify_all()

    def _forget(self, exp: _Expected) -> None:
        """Drop the request once no unit writes into its blocks (a unit in flight ends within
        its frame timeout: written, drained or failed)."""
        self._cond.wait_for(lambda: exp.busy == 0)
        self._expected.pop(exp.request_id, None)
        self._outcomes[exp.request_id] = exp  # so a later DONE gets the real reason
        while len(self._outcomes) > _OUTCOMES_KEPT:
            self._outcomes.popitem(last=False)

    # ------------------------------------------------------------------ connections

    def _serve(self, channel: Channel) -> None:
        try:
            link = self._handshake(channel)
            if channel.posted_recv:
                _Pipeline(self, link).run()
            else:
                self._serve_in_order(link)
        except HandshakeError as e:
            self.stats.refused += 1
            log.warning("refused a KV sender from %s: %s", channel.peer, e)
        except TransportError as e:
            self._lost(channel, e)

    def _serve_in_order(self, link: _Link) -> None:
        """One message at a time: a unit's payload is received and verified before the next
        header is read (byte streams cannot do otherwise)."""
        replying = None  # a RESULT still on the wire: it must not block the next message
        while True:
            self._delay()
            header, body = recv_msg(link.channel, None, self.timeout)
            if replying is not None:
                replying(self.timeout)
            replying = self._dispatch(link, header, body)

    def _delay(self) -> None:
        if self.faults is not None and self.faults.receive_delay:
            time.sleep(self.faults.receive_delay)  # fault injection: a slow receiver

    def _handshake(self, channel: Channel) -> _Link:
        """Accept a sender whose layout has heads for this rank: where its units land, and the
        sender's transfer path (host, staged)."""
        sender, path = accept_handshake(channel, self.layout, self.secret, self.timeout, exact=False)
        heads = receiver_heads(check_layouts(sender, self.layout))
        if self.stager is None:
            return _Link(channel, KVBytes(self.tensor, heads), sender.rank, path)
        kv = KVShape(self.tensor, heads)
        if kv.staged:
            raise HandshakeError("tp", "a device KV tensor receives whole slabs only: a head slice of its "
                                 "blocks is not supported on the staged path")
        return _Link(channel, kv, sender.rank, path)

    def _lost(self, channel: Channel, error: TransportError) -> None:
        """The channel broke: every request it was feeding fails with that error."""
        with self._cond:
            closing = self._closed
            fed = [e for e in self._expected.values() if channel in e.channels and e.state == "pending"]
            for exp in fed:
                self._fail(exp, error if isinstance(error, PeerLostError) else PeerLostError(str(error)))
        if closing or not fed:  # a sender that hangs up between transfers is no news
            log.debug("KV sender %s disconnected (%s)", channel.peer, error)
            return
        self.stats.peers_lost += 1
        log.warning("KV sender %s lost (%s); %d transfer(s) failed", channel.peer, error, len(fed))

    def _dispatch(self, link: _Link, header: Header, body: bytes) -> Callable[[float], None] | None:
        """Handle one message; returns the wait for a reply still being sent, if any."""
        if header.kind is Kind.UNIT:
            self._receive_unit(link, header, body)
        elif header.kind is Kind.DONE:
            return self._complete(link, header, parse_json(body))
        elif header.kind is Kind.CANCEL:
            self._sender_cancelled(str(parse_json(body).get("request_id")))
        else:
            raise ProtocolError(f"unexpected {header.kind.name} from a sender")
        return None

    # ------------------------------------------------------------------ units

    def _receive_unit(self, link: _Link, header: Header, body: bytes) -> None:
        request_id, ids, lengths = parse_unit_body(header, body)
        exp = self._claim(link, request_id, header.layer, ids, header.payload_len)
        if exp is None:
            self._drain(link.channel, lengths)
            return
        slot = self._landing(header.payload_len)
        try:
            views, commit = self._unit_views(link.kv, header.layer, ids, slot)
            actual, expected = receive_payload(link.channel, views, self.timeout, lengths)
            self._land(slot, header.layer, ids, actual == expected, commit)
        finally:
            self._release(exp, slot)
        self._verified(exp, header, expected, actual, link.src_rank, link.path)

    def _landing(self, payload_len: int) -> Slot | None:
        """A staging slot for a unit bound for device memory (None: received in place)."""
        return None if self.stager is None else self.stager.landing(payload_len, self.timeout)

    def _unit_views(self, kv: KVShape, layer: int, ids: list[int], slot: Slot | None
                    ) -> tuple[list[memoryview], Callable[[], None] | None]:
        """Where a unit lands, and what puts it in place once verified (None: nothing more)."""
        if slot is None:
            return kv.write_views(layer, ids)  # type: ignore[attr-defined]
        kv.check(layer, ids)
        return [slot.view()], None

    def _land(self, slot: Slot | None, layer: int, ids: list[int], intact: bool,
              commit: Callable[[], None] | None = None) -> None:
        """A unit into its blocks, only when it arrived intact: a head slice scattered
        (`commit`, while still claimed), a staged unit copied to the device."""
        if not intact:
            return
        if commit is not None:
            commit()
        if slot is not None:
            self.stager.land(slot, layer, ids)  # type: ignore[union-attr]

    def _release(self, exp: _Expected | None, slot: Slot | None = None) -> None:
        """A unit claimed by `_claim` no longer writes into the request's blocks (its staging
        slot, if any, is free again)."""
        if slot is not None:
            self.stager.ring.release(slot)  # type: ignore[union-attr]
        if exp is not None:
            with self._cond:
                exp.busy -= 1
                self._cond.notify_all()

    def _claim(self, link: _Link, request_id: str, layer: int, ids: list[int],
               payload_len: int) -> _Expected | None:
        """The request's record, marked busy, when this unit may be written; else None (drain)."""
        with self._cond:
            exp = self._expected.get(request_id)
            if exp is None or exp.state != "pending":
                return None
            exp.channels.add(link.channel)
            if not exp.blocks.issuperset(ids) or not 0 <= layer < self.layout.num_layers:
                self._fail(exp, ProtocolError(
                    f"request {request_id!r}: unit for layer {layer} writes blocks it did not reserve"))
                return None
            if payload_len != link.kv.unit_bytes(len(ids)):
                self._fail(exp, ProtocolError(
                    f"request {request_id!r}: unit of {len(ids)} blocks carries {payload_len} bytes, "
                    f"expected {link.kv.unit_bytes(len(ids))}"))
                return None
            exp.busy += 1
            if exp.log is not None and not exp.first_ns:
                exp.first_ns = time.time_ns()
            return exp

    def _verified(self, exp: _Expected, header: Header, expected: int, actual: int, src_rank: int,
                  path: str = HOST) -> None:
        with self._cond:
            if actual != expected:
                self.stats.checksum_failures += 1
                log.error("KV unit of request %r layer %d failed its checksum; the transfer is failed",
                          exp.request_id, header.layer)
                self._fail(exp, ChecksumError(exp.request_id, header.layer, expected, actual))
                return
            exp.units += 1
            exp.src_units[src_rank] = exp.src_units.get(src_rank, 0) + 1
            exp.bytes += header.payload_len
            self.stats.units += 1
            self.stats.bytes += header.payload_len
            self.stats.bytes_by_path[path] = self.stats.bytes_by_path.get(path, 0) + header.payload_len
            if exp.log is not None:
                exp.log.append(UnitRecord(time.time_ns(), header.layer, header.num_blocks,
                                          header.payload_len, actual))

    def _drain(self, channel: Channel, lengths: list[int]) -> None:
        """Consume a payload nobody may use, in frames as the sender cut it (then the trailer)."""
        for size in [*lengths, TRAILER.size]:
            self._drain_frame(channel, size)

    def _drain_frame(self, channel: Channel, nbytes: int) -> None:
        views = []
        while nbytes:
            n = min(nbytes, self._drain_buf.nbytes)
            views.append(self._drain_buf[:n])  # the same buffer again: contents are thrown away
            nbytes -= n
        if views:
            channel.recv_into(views, self.timeout)

    # ------------------------------------------------------------------ completion

    def _complete(self, link: _Link, header: Header, msg: dict) -> Callable[[float], None] | None:
        """A source rank's DONE: its units all in? The request is done once every source's is."""
        request_id, src = str(msg.get("request_id")), link.src_rank
        with self._cond:
            exp = self._expected.get(request_id)
            if exp is not None and exp.state == "pending":
                arrived = exp.src_units.get(src, 0)
                if arrived == header.count:
                    exp.done_srcs.add(src)
                    traceparent = msg.get("traceparent")  # optional: a sender without tracing omits it
                    if src == min(exp.done_srcs):
                        exp.meta = dict(msg.get("meta") or {})
                        exp.traceparent = traceparent if isinstance(traceparent, str) else None
                    if len(exp.done_srcs) >= int(msg.get("sources", 1)):
                        exp.state = "done"
                        self._cond.notify_all()
                else:
                    self._fail(exp, ProtocolError(
                        f"request {request_id!r}: sender rank {src} sent {header.count} units, {arrived} arrived"))
            reply = _result(request_id, exp if exp is not None else self._outcomes.get(request_id), src)
        return link.channel.post_many(message_frames(Header(Kind.RESULT), json_body(reply)), self.timeout)

    def _sender_cancelled(self, request_id: str) -> None:
        with self._cond:
            exp = self._expected.get(request_id)
            if exp is not None:
                self._fail(exp, TransferCancelledError(f"request {request_id!r} was cancelled by the sender"))


def _result(request_id: str, exp: _Expected | None, src_rank: int) -> dict:
    """The RESULT for source rank `src_rank`'s DONE: ok once its own part is in and verified."""
    if exp is None:
        return {"request_id": request_id, "ok": False, "error": {
            "type": "TransferCancelledError", "message": f"request {request_id!r} is not expected (cancelled?)"}}
    if exp.state == "done" or (exp.state == "pending" and src_rank in exp.done_srcs):
        return {"request_id": request_id, "ok": True}
    err = exp.error
    detail: dict = {"type": type(err).__name__, "message": str(err)}
    if isinstance(err, ChecksumError):
        detail.update(layer=err.layer, expected=err.expected, actual=err.actual)
    return {"request_id": request_id, "ok": False, "error": detail}


@dataclass(slots=True, eq=False)
class _PostedUnit:
    """A unit whose payload receives are posted: `exp` None means drained (nobody's blocks)."""

    exp: _Expected | None
    header: Header
    receipt: PayloadReceipt
    ids: list[int] = field(default_factory=list)
    slot: Slot | None = None  # where a unit bound for device memory lands first
    commit: Callable[[], None] | None = None  # a head slice: scattered once verified


class _Pipeline:
    """One connection on a backend that posts receives ahead (ucxx). This thread reads the
    control lane and posts each unit's payload receives as soon as its header is in; a verifier
    thread waits for the payloads in order, hashes each frame as it lands, checks the trailer,
    and handles DONE / CANCEL after the units sent before them. So the next unit's data flows
    while the previous one is hashed, instead of waiting for its receives to be posted."""

    def __init__(self, receiver: KVReceiver, link: _Link) -> None:
        self.r, self.link, self.channel = receiver, link, link.channel
        self.work: queue.Queue[_PostedUnit | tuple[Header, bytes] | None] = queue.Queue(PIPELINE_DEPTH)
        self.error: TransportError | None = None  # the verifier's, reported instead of "closed"

    def run(self) -> None:
        verifier = threading.Thread(target=self._verify_loop, daemon=True,
                                    name=f"kv-receiver-verify-{self.channel.peer}")
        verifier.start()
        failure: TransportError | None = None
        try:
            while True:
                self.r._delay()
                header, body = recv_msg(self.channel, None, self.r.timeout)
                if header.kind is Kind.UNIT:
                    self.work.put(self._post_unit(header, body))
                elif header.kind in (Kind.DONE, Kind.CANCEL):
                    self.work.put((header, body))
                else:
                    raise ProtocolError(f"unexpected {header.kind.name} from a sender")
        except TransportError as e:
            failure = e
        finally:
            self.channel.close()  # pending receives fail at once; the verifier drains the rest
            self.work.put(None)
            verifier.join()
        assert failure is not None, "the control loop only ends by raising"
        raise self.error or failure

    def _post_unit(self, header: Header, body: bytes) -> _PostedUnit:
        request_id, ids, lengths = parse_unit_body(header, body)
        exp = self.r._claim(self.link, request_id, header.layer, ids, header.payload_len)
        slot = None
        try:
            commit = None
            if exp is None:
                views = self._throwaway_views(header.payload_len)
            else:
                slot = self.r._landing(header.payload_len)
                views, commit = self.r._unit_views(self.link.kv, header.layer, ids, slot)
            return _PostedUnit(exp, header, PayloadReceipt(self.channel, views, lengths), ids, slot, commit)
        except BaseException:
            self.r._release(exp, slot)
            raise

    def _throwaway_views(self, payload_len: int) -> list[memoryview]:
        """Views a drained payload lands in: one shared throw-away buffer per frame."""
        scratch = memoryview(bytearray(min(payload_len, FRAME_BYTES)))
        full, rest = divmod(payload_len, FRAME_BYTES)
        return [scratch] * full + ([scratch[:rest]] if rest else [])

    def _verify_loop(self) -> None:
        replying = None  # the last RESULT still on the wire
        while (item := self.work.get()) is not None:
            if self.error is not None:  # the connection failed: only release what was claimed
                if isinstance(item, _PostedUnit):
                    self.r._release(item.exp, item.slot)
                continue
            try:
                if isinstance(item, _PostedUnit):
                    self._finish_unit(item)
                    continue
                if replying is not None:
                    replying(self.r.timeout)
                replying = self.r._dispatch(self.link, *item)
            except TransportError as e:
                self.error = e
                self.channel.close()  # wakes the control thread; no receive writes after it

    def _finish_unit(self, unit: _PostedUnit) -> None:
        try:
            actual, expected = unit.receipt.finish(self.r.timeout, verify=unit.exp is not None)
            self.r._land(unit.slot, unit.header.layer, unit.ids, actual == expected, unit.commit)
        except BaseException:
            self.channel.close()  # before the release: no posted receive may write after it
            raise
        finally:
            self.r._release(unit.exp, unit.slot)
        if unit.exp is not None:
            self.r._verified(unit.exp, unit.header, expected, actual, self.link.src_rank, self.link.path)
