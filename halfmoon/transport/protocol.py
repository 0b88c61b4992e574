"""Wire format: every message is a fixed-size header frame, then an optional body frame, then
(for a transfer unit) the payload frames.

    header (36 B) = magic "HMKV" | kind u8 | pad | layer u32 | body_len u32 | num_blocks u32
                    | payload_len u64 | count u64
    UNIT payload  = frames of <= FRAME_BYTES, cut where the body says (see below), then an
                    8-byte trailer: xxh3-64 of the payload.
                    A trailer, not a header field, so both ends hash each frame while it is
                    still in cache and the hashing overlaps the other end's work.
    body          = UNIT: int32 block ids (num_blocks), uint64 frame lengths (count), request id
                    (utf-8); others: a JSON object

The sender cuts a unit's payload where its own views or the receiver's break (it knows both
block lists), so every large run is sent and received in place; only small pieces of
fragmented block tables are gathered into staged frames (frames.frame_lengths).

Connection setup (the receiver listens, the sender connects):

    receiver -> CHALLENGE {nonce}
    sender   -> HELLO {version, layout, mac = HMAC-SHA256(secret, nonce | layout)}
    receiver -> ACCEPT {layout} | REFUSE {field, message}

Each side's layout names its tensor-parallel size, rank and KV heads: a KV push between two
layouts moves the heads `transport.heads.check_layouts` gives the pair (block pulls, `exact`,
only between equal layouts).

Then the sender streams UNIT (request, layer, destination block ids, payload, checksum trailer), DONE
(request, number of units, metadata such as the first token, and optionally `traceparent`: the
sender's span of the request, W3C, so the receiver's transfer span joins the request's trace; an
optional key of the JSON body, so no version change: a receiver without tracing ignores it, a
sender without tracing omits it) and CANCEL; the receiver answers
each DONE with a RESULT {ok | error}. A message backend carries a unit's payload frames and
trailer on a data lane of their own (`Channel.post_many(..., data_from=...)`), so a receiver
that posts receives ahead (`Channel.posted_recv`) reads the next headers while payload lands.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from halfmoon.transport.channel import Channel
from halfmoon.transport.errors import HandshakeError, ProtocolError
from halfmoon.transport.faults import flip_one_bit
from halfmoon.transport.frames import frame_lengths, new_hash, split_at, split_frames
from halfmoon.transport.heads import check_layouts
from halfmoon.transport.layout import KVLayout, KVShape, run_bounds
from halfmoon.transport.staging import HOST, PATHS

# 2: payload frames and trailers on a data lane of their own (ucxx tags); 3: the sender's frame
# cuts travel in the UNIT body; 4: a body beyond one control frame travels in CONTROL_BYTES frames
# (a message backend keeps control receives of that size posted ahead); 5: each side's layout
# names its tensor-parallel rank and the model's KV heads, ACCEPT carries the receiver's, DONE
# the number of sources feeding the receiver (transport/heads.py).
PROTOCOL_VERSION = 5
MAGIC = b"HMKV"
_HEADER = struct.Struct("<4sB3xIIIQQ")
TRAILER = struct.Struct("<Q")
HEADER_BYTES = _HEADER.size
MAX_BODY_BYTES = 1 << 24  # a unit of 4M block ids; anything larger is a broken peer
# A message's body rides in the header's frame up to this size (a unit of ~16k block ids).
CONTROL_BYTES = 64 << 10
INLINE_BODY_BYTES = CONTROL_BYTES - HEADER_BYTES
# Payload frames: both ends cut a unit at the same offsets (see frames.split_frames). 4 MB: large
# enough for UCX's rendezvous path, small enough to hash from cache right after it moved.
FRAME_BYTES = 4 << 20
# A piece of a payload that lies in one view on both ends gets frames of its own from this size
# on (zero copy on a message backend); smaller pieces are gathered into staged frames.
MIN_DIRECT_BYTES = 256 << 10


class Kind(enum.IntEnum):
    CHALLENGE = 1
    HELLO = 2
    ACCEPT = 3
    REFUSE = 4
    UNIT = 5
    DONE = 6
    CANCEL = 7
    RESULT = 8
    FETCH = 9  # block pulls (transport.blocks): the hashes a client wants
    BLOCKS = 10  # the leading ones the server holds: count, payload, trailer


@dataclass(slots=True)
class Header:
    kind: Kind
    layer: int = 0
    body_len: int = 0
    num_blocks: int = 0
    payload_len: int = 0
    count: int = 0

    def pack_into(self, buf: bytearray) -> memoryview:
        _HEADER.pack_into(buf, 0, MAGIC, self.kind, self.layer, self.body_len, self.num_blocks,
                          self.payload_len, self.count)
        return memoryview(buf)[:HEADER_BYTES]

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview) -> Header:
        magic, kind, layer, body_len, num_blocks, payload_len, count = _HEADER.unpack_from(buf)
        if magic != MAGIC:
            raise HandshakeError("protocol", f"the peer does not speak the Halfmoon KV protocol (magic {magic!r})")
        try:
            kind = Kind(kind)
        except ValueError as e:
            raise ProtocolError(f"unknown message kind {kind}") from e
        if body_len > MAX_BODY_BYTES:
            raise ProtocolError(f"message body of {body_len} bytes exceeds {MAX_BODY_BYTES}")
        return cls(kind, layer, body_len, num_blocks, payload_len, count)


# ---------------------------------------------------------------- bodies


def unit_body(request_id: str, block_ids: Sequence[int], lengths: Sequence[int]) -> bytes:
    """The UNIT body; the header's num_blocks = len(block_ids), count = len(lengths)."""
    return (np.asarray(block_ids, dtype="<i4").tobytes() + np.asarray(lengths, dtype="<u8").tobytes()
            + request_id.encode())


def parse_unit_body(header: Header, body: bytes) -> tuple[str, list[int], list[int]]:
    """(request id, destination block ids, frame lengths), the lengths checked against the
    header's payload length."""
    ids_len, cuts_len = 4 * header.num_blocks, 8 * header.count
    if len(body) < ids_len + cuts_len:
        raise ProtocolError(f"unit body of {len(body)} bytes cannot hold {header.num_blocks} block ids "
                            f"and {header.count} frame lengths")
    ids = np.frombuffer(body, dtype="<i4", count=header.num_blocks).tolist()
    lengths = np.frombuffer(body, dtype="<u8", count=header.count, offset=ids_len)
    if header.payload_len and (int(lengths.sum()) != header.payload_len or int(lengths.min()) == 0
                               or int(lengths.max()) > FRAME_BYTES):
        raise ProtocolError(f"frame lengths of a unit do not cut its {header.payload_len} bytes into "
                            f"frames of 1..{FRAME_BYTES} bytes")
    if not header.payload_len and header.count:
        raise ProtocolError("frame lengths for an empty payload")
    return body[ids_len + cuts_len :].decode(), ids, lengths.tolist()


def unit_frame_lengths(kv: KVShape, src_ids: Sequence[int], dst_ids: Sequence[int], nbytes: int,
                       dst_staged: bool = False) -> list[int]:
    """Where the sender cuts a unit (see frames.frame_lengths); `dst_staged`: the receiver
    lands it in one staging buffer (a head slice of its slabs)."""
    dst_bounds = [] if dst_staged else run_bounds(dst_ids, kv.slab_bytes)
    return frame_lengths(kv.bounds(src_ids), dst_bounds, nbytes, FRAME_BYTES, MIN_DIRECT_BYTES)


def json_body(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def parse_json(body: bytes) -> dict:
    try:
        obj = json.loads(body)
    except ValueError as e:
        raise ProtocolError(f"malformed JSON body: {e}") from e
    if not isinstance(obj, dict):
        raise ProtocolError("JSON body is not an object")
    return obj


# ---------------------------------------------------------------- handshake


def hello(layout: KVLayout, nonce: bytes, secret: bytes | None, path: str = "host") -> dict:
    """`path`: how the sender's units leave its KV (transport/staging.py: host, staged)."""
    msg = {"version": PROTOCOL_VERSION, "layout": layout.as_dict(), "path": path}
    msg["mac"] = _mac(secret, nonce, msg) if secret is not None else None
    return msg


def check_hello(msg: dict, layout: KVLayout, nonce: bytes, secret: bytes | None,
                exact: bool = True) -> KVLayout:
    """The sender's layout; `HandshakeError(field, ...)` naming the first thing that differs
    (`exact`: every field of the layouts; else `heads.check_layouts`)."""
    version = msg.get("version")
    if version != PROTOCOL_VERSION:
        raise HandshakeError("version", f"sender speaks protocol {version}, this receiver {PROTOCOL_VERSION}")
    _check_secret(msg, nonce, secret)
    if msg.get("path", HOST) not in PATHS:
        raise HandshakeError("path", f"sender's transfer path {msg.get('path')!r} is none of {list(PATHS)}")
    theirs = msg.get("layout")
    if not isinstance(theirs, dict):
        raise HandshakeError("protocol", "hello carries no KV layout")
    if exact:
        for name, mine in layout.as_dict().items():
            if theirs.get(name) != mine:
                raise HandshakeError(name, f"sender has {name}={theirs.get(name)!r}, receiver has {mine!r}")
    sender = _layout(theirs)
    if not exact:
        check_layouts(sender, layout)
    return sender


def _layout(d: dict) -> KVLayout:
    try:
        return KVLayout.from_dict(d)
    except ProtocolError as e:
        raise HandshakeError("protocol", str(e)) from e


class Accepted(NamedTuple):
    """What the listening side learns from a sender's HELLO: its KV layout and its transfer
    path (transport/staging.py: host, staged)."""

    layout: KVLayout
    path: str


def offer_handshake(channel: Channel, layout: KVLayout, secret: bytes | None, timeout: float,
                    path: str = "host") -> KVLayout:
    """The connecting side: answer the CHALLENGE with HELLO (naming this side's `path`); the
    receiver's layout (from its ACCEPT); raises HandshakeError on REFUSE."""
    header, body = recv_msg(channel, timeout, timeout)
    if header.kind is not Kind.CHALLENGE:
        raise HandshakeError("protocol", f"expected CHALLENGE, got {header.kind.name}")
    nonce = bytes.fromhex(str(parse_json(body).get("nonce", "")))
    send_json(channel, Kind.HELLO, hello(layout, nonce, secret, path), timeout)
    header, body = recv_msg(channel, timeout, timeout)
    if header.kind is Kind.REFUSE:
        msg = parse_json(body)
        raise HandshakeError(str(msg.get("field")), str(msg.get("message")))
    if header.kind is not Kind.ACCEPT:
        raise HandshakeError("protocol", f"expected ACCEPT, got {header.kind.name}")
    return _layout(parse_json(body).get("layout"))


def accept_handshake(channel: Channel, layout: KVLayout, secret: bytes | None, timeout: float,
                     exact: bool = True) -> Accepted:
    """The listening side: CHALLENGE, check the HELLO, ACCEPT (with this side's layout) or
    REFUSE (naming the field); the sender's layout and path (host when its HELLO names none)."""
    nonce = os.urandom(16)
    send_json(channel, Kind.CHALLENGE, {"nonce": nonce.hex()}, timeout)
    header, body = recv_msg(channel, timeout, timeout)
    if header.kind is not Kind.HELLO:
        raise HandshakeError("protocol", f"expected HELLO, got {header.kind.name}")
    msg = parse_json(body)
    try:
        sender = check_hello(msg, layout, nonce, secret, exact)
    except HandshakeError as e:
        send_json(channel, Kind.REFUSE, {"field": e.field, "message": e.message}, timeout)
        raise
    send_json(channel, Kind.ACCEPT, {"layout": layout.as_dict()}, timeout)
    return Accepted(sender, str(msg.get("path", HOST)))


def _check_secret(msg: dict, nonce: bytes, secret: bytes | None) -> None:
    mac = msg.get("mac")
    if secret is None:
        if mac is not None:
            raise HandshakeError("secret", "the sender uses a shared secret but this receiver has none configured")
        return
    if not isinstance(mac, str):
        raise HandshakeError("secret", "this receiver requires a shared secret and the sender sent none")
    unsigned = {k: v for k, v in msg.items() if k != "mac"}
    if not hmac.compare_digest(mac, _mac(secret, nonce, unsigned)):
        raise HandshakeError("secret", "the shared secrets differ")


def _mac(secret: bytes, nonce: bytes, msg: dict) -> str:
    return hmac.new(secret, nonce + json_body(msg), hashlib.sha256).hexdigest()


# ---------------------------------------------------------------- messages on a channel


def message_frames(header: Header, body: bytes) -> list[list[memoryview]]:
    """The frames of a message: header and body in one contiguous frame when the body fits
    INLINE_BODY_BYTES (one message, and no staging copy, on a message backend); else the header,
    then the body in frames of at most CONTROL_BYTES (so a message backend can keep control
    receives of that size posted ahead: `Channel.recv_control`)."""
    header.body_len = len(body)
    if len(body) <= INLINE_BODY_BYTES:
        buf = bytearray(HEADER_BYTES + len(body))
        header.pack_into(buf)
        buf[HEADER_BYTES:] = body
        return [[memoryview(buf)]]
    view = memoryview(body)
    return [[header.pack_into(bytearray(HEADER_BYTES))],
            *([view[i : i + CONTROL_BYTES]] for i in range(0, len(body), CONTROL_BYTES))]


def send_msg(channel: Channel, header: Header, body: bytes, timeout: float) -> None:
    """Header + body (payload frames, if any, are the caller's)."""
    channel.send_many(message_frames(header, body), timeout)


def recv_msg(channel: Channel, timeout: float | None, body_timeout: float) -> tuple[Header, bytes]:
    """Wait up to `timeout` (None: forever) for a message to start; a body sent in frames of
    its own then has `body_timeout`. On a message backend the header and an inline body arrive
    in one control receive (`Channel.recv_control`); on a byte stream they are read back to back."""
    if channel.message_based:
        buf = channel.recv_control(CONTROL_BYTES, timeout)
        header = Header.unpack(buf)
        if header.body_len <= INLINE_BODY_BYTES:
            return header, bytes(buf[HEADER_BYTES : HEADER_BYTES + header.body_len])
        return header, _recv_body_frames(channel, header.body_len, body_timeout)
    buf = bytearray(HEADER_BYTES)
    channel.recv_into([memoryview(buf)], timeout)
    header = Header.unpack(buf)
    body = bytearray(header.body_len)
    if body:
        channel.recv_into([memoryview(body)], body_timeout)
    return header, bytes(body)


def _recv_body_frames(channel: Channel, body_len: int, timeout: float) -> bytes:
    """A body sent in frames of at most CONTROL_BYTES (message_frames), read as control frames."""
    parts = []
    for start in range(0, body_len, CONTROL_BYTES):
        parts.append(bytes(channel.recv_control(CONTROL_BYTES, timeout)[: min(CONTROL_BYTES, body_len - start)]))
    return b"".join(parts)


def post_payload(channel: Channel, head: list[list[memoryview]], views: Sequence[memoryview],
                 timeout: float, corrupt: bool = False,
                 lengths: Sequence[int] | None = None) -> Callable[[float], None] | None:
    """Post a message's `head` frames, then `views` as payload frames (the data lane; cut at
    `lengths`, else every FRAME_BYTES) and an xxh3-64 trailer; returns the wait for the sends
    (None: already done). Each frame is hashed right before it goes out, so hashing overlaps
    the transfer of the frames before it. `corrupt` (fault injection) sends a copy with one bit
    flipped, hashed true."""
    wire = [flip_one_bit(views[0]), *views[1:]] if corrupt and views else list(views)
    true_frames = list(_cut(views, lengths))
    trailer = bytearray(TRAILER.size)
    frames = [*head, *_cut(wire, lengths), [memoryview(trailer)]]
    h = new_hash()

    def before(i: int) -> None:
        if len(head) <= i < len(frames) - 1:
            for v in true_frames[i - len(head)]:
                h.update(v)
        elif i == len(frames) - 1:
            TRAILER.pack_into(trailer, 0, h.intdigest())

    return channel.post_many(frames, timeout, before, data_from=len(head))


def receive_payload(channel: Channel, views: Sequence[memoryview], timeout: float,
                    lengths: Sequence[int] | None = None) -> tuple[int, int]:
    """A payload sent by `post_payload` (with the same `lengths`), straight into `views` (each
    frame hashed as it lands), then its trailer. Returns (hash of what arrived, hash the sender
    computed)."""
    if channel.posted_recv:
        return PayloadReceipt(channel, views, lengths).finish(timeout)
    frames, trailer = _payload_frames(views, lengths)
    h = new_hash()

    def after(i: int) -> None:
        if i < len(frames) - 1:
            for v in frames[i]:
                h.update(v)

    channel.recv_many(frames, timeout, after)
    return h.intdigest(), TRAILER.unpack(trailer)[0]


class PayloadReceipt:
    """A payload whose frame and trailer receives are posted now (`Channel.post_recvs`, a
    backend with `posted_recv`); `finish` waits for them, possibly on another thread."""

    def __init__(self, channel: Channel, views: Sequence[memoryview], lengths: Sequence[int] | None = None) -> None:
        self._frames, self._trailer = _payload_frames(views, lengths)
        self._posted = channel.post_recvs(self._frames)

    def finish(self, timeout: float, verify: bool = True) -> tuple[int, int]:
        """Wait for every frame in order, hashing each as it lands (unless not `verify`, e.g.
        a drained payload); (hash of what arrived, hash the sender computed)."""
        h = new_hash()
        last = len(self._frames) - 1
        for i, frame in enumerate(self._frames):
            self._posted.wait(i, timeout)
            if verify and i < last:
                for v in frame:
                    h.update(v)
        return h.intdigest(), TRAILER.unpack(self._trailer)[0]


def _payload_frames(views: Sequence[memoryview], lengths: Sequence[int] | None
                    ) -> tuple[list[list[memoryview]], bytearray]:
    """The frames a payload is cut into (as `post_payload` cuts it), then its trailer's."""
    trailer = bytearray(TRAILER.size)
    return [*_cut(views, lengths), [memoryview(trailer)]], trailer


def _cut(views: Sequence[memoryview], lengths: Sequence[int] | None) -> Iterator[list[memoryview]]:
    return split_frames(views, FRAME_BYTES) if lengths is None else split_at(views, lengths)


def send_json(channel: Channel, kind: Kind, obj: object, timeout: float, count: int = 0) -> None:
    send_msg(channel, Header(kind, count=count), json_body(obj), timeout)
