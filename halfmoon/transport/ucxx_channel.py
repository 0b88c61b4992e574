"""The ucxx backend's channel: tagged messages on one UCX endpoint, in two lanes.

UCX matches tags per worker, not per endpoint, so each channel has a random 62-bit id; the
connecting side sends it over the endpoint's own stream (UCX's per-endpoint ordered byte
stream: `connect` here, read by transport.ucxx_listener) and every frame is then a tag message
with tag = id * 4 + lane * 2 + direction. Two lanes: control (headers, DONE, RESULT) and data
(payload frames and their trailer). Messages of one lane are matched in order, so the receiver
keeps reading headers on the control lane while the payload receives it posted (`post_recvs`)
fill on the data lane: the next unit's frames are posted before the previous unit is hashed,
and UCX never waits for a receive to be posted. A frame of one view is sent / received in place
(zero copy); a frame of several views (a fragmented block table) is packed into / unpacked from
a staging buffer. `send_many` / `recv_many` keep up to WINDOW frames in flight, so hashing a
frame overlaps the next ones.

Every UCX call runs on the runtime's owner thread (transport.ucxx_runtime): a channel posts it
there and waits for its `Op`.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from halfmoon.transport.channel import Channel, PostedRecvs
from halfmoon.transport.errors import PeerLostError, TransferTimeoutError, TransportError
from halfmoon.transport.frames import copy_views, total_bytes
from halfmoon.transport.tcp import parse_address
from halfmoon.transport.ucxx_runtime import Op, UcxRuntime

log = logging.getLogger("halfmoon.transport")
WINDOW = 8  # receives posted ahead per recv_many; staging slots per direction
SEND_WINDOW = 16  # sends in flight per channel (across messages)
CONTROL_AHEAD = 4  # control-lane receives kept posted (recv_control): a header is never waited for twice


class _Stages:
    """WINDOW reusable staging buffers for multi-view frames, taken round robin; a slot is
    reused only once the operation that last used it completed (receives: at most WINDOW are
    posted ahead; sends: `_pack` waits for the slot's last send)."""

    def __init__(self) -> None:
        self._bufs = [bytearray() for _ in range(WINDOW)]

    def get(self, slot: int, nbytes: int) -> memoryview:
        if len(self._bufs[slot]) < nbytes:
            self._bufs[slot] = bytearray(nbytes)
        return memoryview(self._bufs[slot])[:nbytes]


class _StagePool:
    """Staging buffers for posted multi-view receives: taken when posted, given back once
    copied out (deque append / pop are atomic, so the two threads need no lock)."""

    def __init__(self) -> None:
        self._free: deque[bytearray] = deque()

    def take(self, nbytes: int) -> bytearray:
        try:
            buf = self._free.pop()
        except IndexError:
            return bytearray(nbytes)
        return buf if len(buf) >= nbytes else bytearray(nbytes)

    def give(self, buf: bytearray) -> None:
        if len(self._free) < WINDOW:
            self._free.append(buf)


class _UcxxPostedRecvs(PostedRecvs):
    def __init__(self, channel: UcxxChannel, frames: Sequence[Sequence[memoryview]],
                 ops: list[tuple[Op, bytearray | None]]) -> None:
        self._channel, self._frames, self._ops = channel, frames, ops

    def wait(self, i: int, timeout: float | None) -> None:
        op, stage = self._ops[i]
        self._channel._wait(op, timeout, "receive from")
        if stage is not None:
            copy_views([memoryview(stage)[: total_bytes(self._frames[i])]], self._frames[i])
            self._channel._recv_pool.give(stage)


class CloseWatch:
    """Tells a peer's close of an endpoint from our own: UCX calls `fired` (on the owner
    thread) whenever the endpoint closes; `closing` is set before we close it ourselves."""

    __slots__ = ("closing", "rt")

    def __init__(self, rt: UcxRuntime) -> None:
        self.rt, self.closing = rt, False

    def fired(self) -> None:
        if not self.closing:
            self.rt.peer_lost()


def watched(rt: UcxRuntime, endpoint: Any) -> tuple[Any, CloseWatch]:
    """On the owner thread: `endpoint` with a close watch installed."""
    watch = CloseWatch(rt)
    endpoint.set_close_callback(watch.fired)
    return endpoint, watch


class UcxxChannel(Channel):
    message_based = True
    posted_recv = True

    def __init__(self, rt: UcxRuntime, endpoint: Any, watch: CloseWatch, channel_id: int, outbound: bool,
                 peer: str) -> None:
        self._rt = rt
        self._ep = endpoint
        self._watch = watch
        # tag = id*4 + lane*2 + direction: the connecting side sends on direction 0, the
        # listening side on 1; lane 0 is control, lane 1 data.
        mine, theirs = (0, 1) if outbound else (1, 0)
        tag = rt.ucx.UCXXTag
        self._send_tag, self._recv_tag = tag(channel_id * 4 + mine), tag(channel_id * 4 + theirs)
        self._send_data_tag = tag(channel_id * 4 + 2 + mine)
        self._recv_data_tag = tag(channel_id * 4 + 2 + theirs)
        self.peer = peer
        self._send_stages = _Stages()
        self._recv_stages = _Stages()
        self._recv_pool = _StagePool()
        self._in_flight: deque[Op] = deque()  # sends posted on this channel, oldest first
        self._control: deque[Op] = deque()  # control receives posted ahead (buffer in op.result)
        self._slot_ops: list[Op | None] = [None] * WINDOW  # the last send from each send stage
        self._next_slot = 0
        self._closed = threading.Event()  # set when close() starts
        self._endpoint_closed = threading.Event()  # set when no operation can touch memory
        rt.adopt_channel(self)

    def sendv(self, views: Sequence[memoryview], timeout: float) -> None:
        self.send_many([views], timeout)

    def recv_into(self, views: Sequence[memoryview], timeout: float | None) -> None:
        self.recv_many([views], timeout)

    def send_many(self, frames: Sequence[Sequence[memoryview]], timeout: float,
                  before: Callable[[int], None] | None = None) -> None:
        finish = self.post_many(frames, timeout, before)
        finish(timeout)

    def post_many(self, frames: Sequence[Sequence[memoryview]], timeout: float,
                  before: Callable[[int], None] | None = None,
                  data_from: int | None = None) -> Callable[[float], None]:
        """Post every frame (at most SEND_WINDOW sends in flight on the channel, across calls),
        frames from `data_from` on on the data lane; returns the wait for this call's sends.
        One thread sends on a channel at a time."""
        ops: list[Op] = []
        first_data = len(frames) if data_from is None else data_from
        for i, views in enumerate(frames):
            while len(self._in_flight) >= SEND_WINDOW:
                self._wait(self._in_flight.popleft(), timeout, "send to")
            if before is not None:
                before(i)
            staged = len(views) > 1
            buf = self._pack(views, timeout) if staged else views[0]
            array = self._array(buf)
            tag = self._send_data_tag if i >= first_data else self._send_tag
            op = self._post(lambda a=array, t=tag: self._ep.tag_send(a, t))
            if staged:
                self._slot_ops[(self._next_slot - 1) % WINDOW] = op
            ops.append(op)
            self._in_flight.append(op)

        def finish(wait_timeout: float, keep: Sequence[Sequence[memoryview]] = frames) -> None:
            for op in ops:  # `keep` holds the frames' memory until the sends completed
                self._wait(op, wait_timeout, "send to")

        return finish

    def recv_many(self, frames: Sequence[Sequence[memoryview]], timeout: float | None,
                  after: Callable[[int], None] | None = None) -> None:
        pending: deque[tuple[Op, memoryview | None]] = deque()
        posted = 0
        for i in range(len(frames)):
            while posted < len(frames) and posted - i < WINDOW:
                pending.append(self._post_recv(frames[posted], posted))
                posted += 1
            op, stage = pending.popleft()
            self._wait(op, timeout, "receive from")
            if stage is not None:
                copy_views([stage], frames[i])
            if after is not None:
                after(i)

    def recv_control(self, nbytes: int, timeout: float | None) -> memoryview:
        """The next control message, from CONTROL_AHEAD receives of `nbytes` kept posted on the
        control lane (the caller reads every control message this way: see Channel)."""
        missing = CONTROL_AHEAD - len(self._control)
        if missing > 0:
            bufs = [bytearray(nbytes) for _ in range(missing)]
            ops = self._post_recvs([memoryview(buf) for buf in bufs], self._recv_tag)
            for op, buf in zip(ops, bufs):
                op.result = buf  # lives as long as the op: until the receive completed or failed
            self._control.extend(ops)
        op = self._control[0]
        if len(op.result) != nbytes:
            raise ValueError(f"control receives are posted with {len(op.result)} bytes, not {nbytes}")
        self._wait(op, timeout, "receive from")
        self._control.popleft()
        return memoryview(op.result)

    def post_recvs(self, frames: Sequence[Sequence[memoryview]]) -> PostedRecvs:
        stages = [None if len(views) == 1 else self._recv_pool.take(total_bytes(views)) for views in frames]
        targets = [views[0] if stage is None else memoryview(stage) for views, stage in zip(frames, stages)]
        ops = self._post_recvs(targets, self._recv_data_tag)
        return _UcxxPostedRecvs(self, frames, list(zip(ops, stages)))

    def _post_recvs(self, targets: Sequence[memoryview], tag: Any) -> list[Op]:
        """A tag receive into each target, posted with one owner wake-up."""
        arrays = [self._array(target) for target in targets]
        if self._closed.is_set():
            raise PeerLostError(f"channel to {self.peer} is closed")
        return self._rt.post_all([lambda a=array: self._ep.tag_recv(a, tag) for array in arrays])

    def _post_recv(self, views: Sequence[memoryview], i: int) -> tuple[Op, memoryview | None]:
        if self._control:
            raise RuntimeError("this channel's control lane is read by recv_control (receives posted ahead): "
                               "recv_into / recv_many on it would take messages out of order")
        stage = None if len(views) == 1 else self._recv_stages.get(i % WINDOW, total_bytes(views))
        array = self._array(views[0] if stage is None else stage)
        return self._post(lambda: self._ep.tag_recv(array, self._recv_tag)), stage

    def _pack(self, views: Sequence[memoryview], timeout: float) -> memoryview:
        """Copy a multi-view frame into the next staging slot (once its last send completed)."""
        slot = self._next_slot
        self._next_slot = (slot + 1) % WINDOW
        previous = self._slot_ops[slot]
        if previous is not None:
            self._wait(previous, timeout, "send to")
        stage = self._send_stages.get(slot, total_bytes(views))
        copy_views(views, [stage])
        return stage

    def _array(self, view: memoryview) -> Any:
        return self._rt.Array(np.frombuffer(view, np.uint8))

    def _post(self, fn: Callable[[], Any]) -> Op:
        if self._closed.is_set():
            raise PeerLostError(f"channel to {self.peer} is closed")
        return self._rt.post(fn)

    def _wait(self, op: Op, timeout: float | None, what: str) -> None:
        """Wait in slices so a close() from another thread is noticed."""
        remaining = timeout
        while not op.wait(0.2 if remaining is None else min(0.2, remaining)):
            if self._closed.is_set():
                # Raise only once the endpoint is closed: a caller that frees the op's memory
                # on this error must not race a receive still writing into it.
                self._endpoint_closed.wait(10.0)
                raise PeerLostError(f"channel to {self.peer} was closed")
            if remaining is not None:
                remaining -= 0.2
                if remaining <= 0:
                    raise TransferTimeoutError(f"{what} {self.peer} made no progress for {timeout:.1f}s")
        self._rt.wait(op, 0, f"{what} {self.peer}")

    def expect_close(self) -> None:
        """Both ends of this channel are ours and about to close: the peer's close is no news."""
        self._watch.closing = True

    def close(self) -> None:
        """Close the endpoint: pending operations on it fail (their waiters see PeerLostError)."""
        if self._closed.is_set():
            self._endpoint_closed.wait(10.0)  # another thread is closing it: wait for that
            return
        self._closed.set()
        self._watch.closing = True
        try:  # wait, so no operation of this endpoint touches memory once close() returned
            self._rt.wait(self._rt.post(self._close_endpoint, is_request=False), 10.0, f"close {self.peer}")
        except TransportError as e:
            log.warning("closing the UCX endpoint to %s: %s", self.peer, e)
        finally:
            self._endpoint_closed.set()

    def _close_endpoint(self) -> None:
        """On the owner thread, which must also drop the last reference (ucxx objects may only
        be destroyed there: a destructor racing the worker's progress crashes)."""
        endpoint, self._ep = self._ep, None
        if endpoint is not None:
            endpoint.close_blocking(period=10**8, max_attempts=1)


def close_held(holder: list[Any], watch: CloseWatch | None = None) -> None:
    """On the owner thread: close an endpoint nobody uses and drop its last reference here."""
    if watch is not None:
        watch.closing = True
    endpoint = holder.pop()
    try:
        endpoint.close_blocking(period=10**8, max_attempts=1)
    except Exception as e:  # already failed: nothing left to close
        log.debug("closing a dropped UCX endpoint: %s", e)




def connect(rt: UcxRuntime, address: str, timeout: float) -> UcxxChannel:
    """A channel to the listener at `address`: connect, then send our channel id."""
    host, port = parse_address(address, "ucxx")
    endpoint, watch = rt.call(lambda: watched(rt, rt.ucx.UCXEndpoint.create(rt.worker, host, port, True)),
                              timeout, f"connect to {address}")
    channel_id = secrets.randbits(62)
    hello = np.array([channel_id], np.uint64)
    array = rt.Array(hello)
    rt.wait(rt.post(lambda: endpoint.stream_send(array)), timeout, f"connect to {address}")
    return UcxxChannel(rt, endpoint, watch, channel_id, outbound=True, peer=address)

