"""UCX backend through `ucxx` (the maintained successor of ucx-py), on its low-level API.

UCX picks the transport per peer (shared memory on one host, TCP or RDMA between hosts);
`UCX_TLS` restricts the choice and is configurable (`UcxxBackend(tls=...)` or the environment).

One thread per process owns the UCX worker (a UCX worker is single-threaded): it runs the posts
other threads queue, progresses the worker, and sets each finished operation's event. While
operations are in flight and events keep coming it polls the worker in C without the GIL
(transport/_ucxspin.c), for up to `poll_s` after the last event: UCX moves a large message in
fragments that each need both ends progressed, and a wake-up per fragment costs about half the
shared-memory throughput. Otherwise it sleeps in `select` on the worker's event fd and a wake-up
pipe (UCX's arm / wait pattern), so an idle process does not spin. A waiting thread blocks on its
operation's event with its timeout. (ucxx's
asyncio API was measured first: a hand-off per operation through its loop and awaits that spin
for the GIL held transfers to 0.3-0.6x of `ucx_perftest`.)

Channels: UCX matches tags per worker, not per endpoint, so each channel has a random 62-bit id;
the connecting side sends it over the endpoint's own stream (UCX's per-endpoint ordered byte
stream) and every frame is then a tag message with tag = id * 4 + lane * 2 + direction. Two
lanes: control (headers, DONE, RESULT) and data (payload frames and their trailer). Messages of
one lane are matched in order, so the receiver keeps reading headers on the control lane while
the payload receives it posted (`post_recvs`) fill on the data lane: the next unit's frames are
posted before the previous unit is hashed, and UCX never waits for a receive to be posted. A
frame of one view is sent / received in place (zero copy); a frame of several views (a
fragmented block table) is packed into / unpacked from a staging buffer. `send_many` /
`recv_many` keep up to WINDOW frames in flight, so hashing a frame overlaps the next ones.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import secrets
import select
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from transport.channel import Backend, Channel, Listener, PostedRecvs
from transport.errors import BackendUnavailableError, PeerLostError, TransferTimeoutError, TransportError
from transport.frames import copy_views, total_bytes
from transport.tcp import parse_address

# Defaults (the caller's environment wins): larger TCP segments and socket buffers (measured on
# loopback: 1.2 -> ~5 GB/s with UCX_TLS=tcp), error handling on the shared-memory transports so a
# dead peer fails pending operations instead of hanging them; SO_REUSEADDR on listeners (a
# replaced worker's listeners rebind their ports: transport.ucxx_recovery).
UCX_ENV_DEFAULTS = {
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_TCP_TX_SEG_SIZE": "1m",
    "UCX_TCP_RX_SEG_SIZE": "1m",
    "UCX_TCP_SNDBUF": "8m",
    "UCX_TCP_RCVBUF": "8m",
    "UCX_SYSV_ERROR_HANDLING": "y",
    "UCX_POSIX_ERROR_HANDLING": "y",
    "UCX_TCP_CM_REUSEADDR": "y",  # a listener can take its port back while old connections linger
}
log = logging.getLogger("halfmoon.transport")
WINDOW = 8  # receives posted ahead per recv_many; staging slots per direction
# A connecting peer sends its channel id right after connecting; one that does not within this
# is dropped (each is greeted on a thread of its own, so a mute one holds up nobody else).
GREET_TIMEOUT_S = 5.0
MOVE_TIMEOUT_S = GREET_TIMEOUT_S + 5.0  # a moving listener waits this long for its port
SEND_WINDOW = 16  # sends in flight per channel (across messages)
CONTROL_AHEAD = 4  # control-lane receives kept posted (recv_control): a header is never waited for twice
POLL_US_DEFAULT = 2000  # keep polling this long after the last event (TransportConfig.ucx_poll_us)
POLL_SLICE_NS = 200_000  # one native polling slice; between slices the owner reaps in Python
RETIRED_TICK_S = 0.1  # how often a replaced runtime's owner thread looks for posts


class Op:
    """One posted UCX operation, finished once by the owner thread (`finish`).

    Completion is a lock held from creation and released by `finish`: a wait or a check is one
    C call, where a threading.Event costs a dozen Python frames on each side, several times per
    transfer unit."""

    __slots__ = ("_pending", "_done", "request", "error", "result")

    def __init__(self) -> None:
        self._pending = threading.Lock()
        self._pending.acquire()
        self._done = False
        self.request: Any = None
        self.error: BaseException | None = None
        self.result: Any = None  # a post's return value; a posted receive's buffer (kept alive)

    def finish(self) -> None:
        """The owner thread: the operation completed (or failed: `error` is set first)."""
        self._done = True
        self._pending.release()

    def wait(self, timeout: float | None) -> bool:
        """True once finished (at once if it already is, whoever else is waiting); False after
        `timeout` seconds."""
        if self._done:
            return True
        if not self._pending.acquire(True, -1 if timeout is None else max(timeout, 0.0)):
            return self._done  # finished while another waiter held the lock for a moment
        self._pending.release()  # stays free for every other waiter
        return True


class _Runtime:
    """The process's UCX context and worker, and the thread that owns them."""

    def __init__(self, tls: str | None, poll_us: int) -> None:
        for key, value in UCX_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        if tls is not None:
            os.environ["UCX_TLS"] = tls
        self.tls = os.environ.get("UCX_TLS")
        try:
            import ucxx._lib.libucxx as ucx
            from ucxx._lib.arr import Array
        except Exception as e:  # ImportError, or a broken native library underneath
            raise BackendUnavailableError("ucxx", f"import ucxx failed: {e} (pip install ucxx-cu12)") from e
        self.ucx, self.Array = ucx, Array
        self.context = ucx.UCXContext(feature_flags=(ucx.Feature.TAG, ucx.Feature.STREAM, ucx.Feature.WAKEUP))
        self.worker = ucx.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self._posts: deque[tuple[Callable[[], Any], Op, bool]] = deque()
        self._watch: list[Op] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.poll_s = poll_us / 1e6  # read by the owner thread on every turn
        self._poll_slice = native_poller(self.worker, self._wake_r)
        # What lives on this worker, so a replacement (transport.ucxx_recovery) can move it.
        self._members_lock = threading.Lock()
        self._listeners: weakref.WeakSet[UcxxListener] = weakref.WeakSet()
        self._channels: weakref.WeakSet[UcxxChannel] = weakref.WeakSet()
        self.suspect = threading.Event()  # a peer closed an endpoint: check this worker
        self.doctor: threading.Thread | None = None  # checks it (transport.ucxx_recovery.watch)
        self.retired = False  # replaced by a new runtime; kept (idle) so nothing is freed early
        self.owner = threading.Thread(target=self._run, name="ucx-owner", daemon=True)
        self.owner.start()

    # ------------------------------------------------------------------ any thread

    def post(self, fn: Callable[[], Any], is_request: bool = True) -> Op:
        """Run `fn` on the owner thread; if it returns a UCX request, `op` finishes when that
        request completes, else as soon as `fn` ran (its return value in `op.result`)."""
        return self.post_all([fn], is_request)[0]

    def post_all(self, fns: Sequence[Callable[[], Any]], is_request: bool = True) -> list[Op]:
        """`post` for several functions at once, with one wake-up of the owner thread."""
        ops = [Op() for _ in fns]
        self._posts.extend((fn, op, is_request) for fn, op in zip(fns, ops))
        os.write(self._wake_w, b"x")
        return ops

    def call(self, fn: Callable[[], Any], timeout: float, what: str) -> Any:
        return self.wait(self.post(fn, is_request=False), timeout, what).result

    def wait(self, op: Op, timeout: float | None, what: str) -> Op:
        if not op.wait(timeout):
            raise TransferTimeoutError(f"{what} made no progress for {timeout:.1f}s")
        if op.error is not None:
            raise PeerLostError(f"{what} failed: {op.error}") from op.error
        return op

    def adopt(self, member: UcxxChannel | UcxxListener) -> None:
        with self._members_lock:
            (self._listeners if isinstance(member, UcxxListener) else self._channels).add(member)

    def members(self) -> tuple[list[UcxxListener], list[UcxxChannel]]:
        with self._members_lock:
            return list(self._listeners), list(self._channels)

    def peer_lost(self) -> None:
        """A peer closed (or lost) an endpoint of this worker: have it checked. On the owner
        thread, so it only sets an event; transport.ucxx_recovery does the rest."""
        from transport.ucxx_recovery import watch

        self.suspect.set()
        watch(self)

    # ------------------------------------------------------------------ the owner thread

    def _run(self) -> None:
        worker = self.worker
        epoll_fd = worker.epoll_file_descriptor
        poll = self._poll_slice
        last_event = 0.0
        while True:
            active = self._submit_posts()
            while worker.progress_once():
                active = True
            self._reap()
            if self._posts:
                continue
            if self.retired:  # a wedged worker may never arm again: tick, do not spin
                self._sleep([self._wake_r], RETIRED_TICK_S)
                continue
            if active:
                last_event = time.monotonic()
            if poll is not None and self._should_poll(last_event):
                if poll():
                    last_event = time.monotonic()
                continue
            if not worker.arm():
                continue  # events arrived while arming: progress again
            self._sleep([epoll_fd, self._wake_r], 0.5)

    def _sleep(self, fds: list[int], timeout: float) -> None:
        select.select(fds, [], [], timeout)
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass  # woken by UCX, not by a post

    def _should_poll(self, last_event: float) -> bool:
        """Poll (rather than sleep) while operations are in flight and the last event is recent."""
        return bool(self._watch) and time.monotonic() - last_event < self.poll_s

    def _submit_posts(self) -> bool:
        """Run the queued posts; False if there were none."""
        if not self._posts:
            return False
        while self._posts:
            fn, op, is_request = self._posts.popleft()
            try:
                result = fn()
                del fn  # a post's closure may hold the last reference to a ucxx object
            except Exception as e:  # the endpoint already failed: the waiter sees it
                op.error = e
                op.finish()
                continue
            if is_request:
                op.request = result
                self._watch.append(op)
            else:
                op.result = result
                op.finish()
        return True

    def _reap(self) -> None:
        if not self._watch:
            return
        still = []
        for op in self._watch:
            if op.request.completed:
                try:
                    op.request.check_error()
                except Exception as e:  # UCXXConnectionResetError, UCXXCanceledError, ...
                    op.error = e
                op.request = None  # released here, on the owner thread
                op.finish()
            else:
                still.append(op)
        self._watch = still


def ucp_progress_address() -> int:
    """The address of `ucp_worker_progress` in the libucp ucxx loaded (OSError if it is not
    loaded, AttributeError if it lacks the symbol)."""
    libucp = ctypes.CDLL("libucp.so.0", mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    return ctypes.cast(libucp.ucp_worker_progress, ctypes.c_void_p).value


def native_poller(worker: Any, wake_fd: int) -> Callable[[], int] | None:
    """One slice of polling `worker` without the GIL (transport._ucxspin.spin): the number of
    events, 0 if none came within the slice or another thread queued a post. None, with a
    warning, when the extension is not built or libucp's progress function cannot be found."""
    try:
        from transport import _ucxspin

        progress = ucp_progress_address()
    except (ImportError, OSError, AttributeError) as e:
        log.warning("the ucxx backend runs without its native polling loop (%s): its owner thread "
                    "sleeps on UCX events between fragments, ~0.7x the shared-memory throughput; "
                    "build it with a C compiler and `pip install -e .`", e)
        return None
    handle, spin = worker.handle, _ucxspin.spin
    return lambda: spin(progress, handle, wake_fd, POLL_SLICE_NS)


_runtime: _Runtime | None = None  # UCX's context is per process, so is its runtime
_runtime_lock = threading.Lock()


def current_runtime() -> _Runtime:
    """The runtime new connections and listeners use (after a replacement, the new one)."""
    if _runtime is None:
        raise RuntimeError("the UCX runtime was not started (create a UcxxBackend first)")
    return _runtime


def replace_runtime(old: _Runtime) -> _Runtime:
    """Start a new runtime (context, worker, owner thread) in place of `old`, move `old`'s
    listeners to it on their own ports and close `old`'s channels (their waiters get
    PeerLostError; senders reconnect). `old` is kept, idle, so nothing it owns is freed under
    a pending operation. Returns the new runtime."""
    global _runtime
    with _runtime_lock:
        if _runtime is not old:
            return current_runtime()  # already replaced
        new = _runtime = _Runtime(old.tls, round(old.poll_s * 1e6))
        _retired.append(old)
    old.retired = True
    listeners, channels = old.members()
    for channel in channels:  # first: a listener's port is free once its endpoints are gone
        channel.close()
    # Receives still posted for closed channels hold their endpoints, and so the listener.
    old.call(old.worker.cancel_inflight_requests, 10.0, "cancel the old worker's operations")
    for listener in listeners:
        listener.move_to(new)
    return new


_retired: list[_Runtime] = []  # replaced runtimes: never destroyed (see replace_runtime)


def runtime(tls: str | None, poll_us: int = POLL_US_DEFAULT) -> _Runtime:
    """The process's UCX runtime, started on first use. `poll_us` applies to the whole process
    (the last backend created sets it)."""
    global _runtime
    if poll_us < 0:
        raise ValueError(f"poll_us must be >= 0, got {poll_us}")
    with _runtime_lock:
        if _runtime is None:
            _runtime = _Runtime(tls, poll_us)
        elif tls is not None and tls != _runtime.tls:
            raise BackendUnavailableError(
                "ucxx", f"UCX is already running with UCX_TLS={_runtime.tls!r} in this process; "
                f"cannot switch to {tls!r}")
        _runtime.poll_s = poll_us / 1e6
        return _runtime


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


class _CloseWatch:
    """Tells a peer's close of an endpoint from our own: UCX calls `fired` (on the owner
    thread) whenever the endpoint closes; `closing` is set before we close it ourselves."""

    __slots__ = ("rt", "closing")

    def __init__(self, rt: _Runtime) -> None:
        self.rt, self.closing = rt, False

    def fired(self) -> None:
        if not self.closing:
            self.rt.peer_lost()


def _watched(rt: _Runtime, endpoint: Any) -> tuple[Any, _CloseWatch]:
    """On the owner thread: `endpoint` with a close watch installed."""
    watch = _CloseWatch(rt)
    endpoint.set_close_callback(watch.fired)
    return endpoint, watch


class UcxxChannel(Channel):
    message_based = True
    posted_recv = True

    def __init__(self, rt: _Runtime, endpoint: Any, watch: _CloseWatch, channel_id: int, outbound: bool,
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
        rt.adopt(self)

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


def _close_held(holder: list[Any], watch: _CloseWatch | None = None) -> None:
    """On the owner thread: close an endpoint nobody uses and drop its last reference here."""
    if watch is not None:
        watch.closing = True
    endpoint = holder.pop()
    try:
        endpoint.close_blocking(period=10**8, max_attempts=1)
    except Exception as e:  # already failed: nothing left to close
        log.debug("closing a dropped UCX endpoint: %s", e)


class UcxxListener(Listener):
    """Accepts UCX connections. Each new endpoint is greeted (its channel id read) on a
    short-lived thread of its own, so a peer that stays mute holds up nobody else."""

    def __init__(self, rt: _Runtime, host: str, port: int, greet_timeout: float = GREET_TIMEOUT_S) -> None:
        self._ready: queue.Queue[UcxxChannel | None] = queue.Queue()
        self._greet_timeout = greet_timeout
        self._lock = threading.Lock()  # orders greeted channels against close()
        self._closed = False
        self._rt, self._held = rt, self._listen(rt, port)
        self.port = self._held[0].port
        self.address = f"ucxx://{host}:{self.port}"
        rt.adopt(self)

    def _listen(self, rt: _Runtime, port: int) -> list[Any]:
        """A UCX listener on `rt`'s worker, in a list only the owner thread empties."""
        held: list[Any] = []

        def create() -> None:  # on the owner thread, before any connection can be delivered
            held.append(rt.ucx.UCXListener.create(rt.worker, port, lambda req: self._on_connect(rt, held, req)))

        rt.call(create, 30.0, "listen")
        return held

    def _on_connect(self, rt: _Runtime, held: list[Any], conn_request: Any) -> None:
        """Runs on the owner thread inside progress: make the endpoint, greet it elsewhere."""
        endpoint, watch = _watched(rt, held[0].create_endpoint_from_conn_request(conn_request, True))
        threading.Thread(target=self._greet, args=(rt, [endpoint], watch), name="ucx-greet", daemon=True).start()

    def move_to(self, rt: _Runtime) -> None:
        """Listen on `rt`'s worker instead, on the same port (see replace_runtime)."""
        if self._closed:
            return
        self._rt.call(self._held.clear, 10.0, "close listener")  # destroyed on its owner thread
        deadline = time.monotonic() + MOVE_TIMEOUT_S
        while True:  # the port is bound until the endpoints accepted on it are gone too
            try:
                self._rt, self._held = rt, self._listen(rt, self.port)
                break
            except TransportError as e:
                if time.monotonic() > deadline:
                    log.error("the UCX listener %s could not move to the new worker: %s; it accepts "
                              "no more connections", self.address, e)
                    self.close()
                    return
                time.sleep(0.1)
        rt.adopt(self)

    def accept(self, timeout: float | None) -> Channel | None:
        """The next peer that introduced itself; None on timeout or once closed. A connection
        that fails or stays mute before sending its channel id (a peer that died or gave up
        while connecting, e.g. a stale attempt at an address this listener now reuses) is
        dropped with a warning and never returned."""
        try:
            channel = self._ready.get(timeout=timeout)
        except queue.Empty:
            return None
        if channel is None:
            self._ready.put(None)  # closed: wake every other waiting accept() too
        return channel

    def _greet(self, rt: _Runtime, holder: list[Any], watch: _CloseWatch) -> None:
        """On a greeting thread: read the channel id, then hand the channel to accept()."""
        try:
            channel = self._introduce(rt, holder, watch)
        except TransportError as e:
            log.warning("dropped an incoming UCX connection on %s: %s", self.address, e)
            rt.post(lambda: _close_held(holder, watch), is_request=False)
            return
        with self._lock:
            if not self._closed and not rt.retired:
                self._ready.put(channel)
                return
        channel.close()  # greeted after the listener closed or its worker was replaced

    def _introduce(self, rt: _Runtime, holder: list[Any], watch: _CloseWatch) -> UcxxChannel:
        """The connecting side's first bytes on the endpoint's stream: its channel id."""
        hello = np.zeros(1, np.uint64)
        array = rt.Array(hello)
        rt.wait(rt.post(lambda: holder[0].stream_recv(array)), self._greet_timeout, "channel id from a new peer")
        channel_id = int(hello[0])
        return UcxxChannel(rt, holder.pop(), watch, channel_id, outbound=False, peer=f"ucxx-peer-{channel_id:x}")

    def close(self) -> None:
        """Stop accepting: waiting accept() calls return None; channels greeted but not
        accepted are closed."""
        with self._lock:
            self._closed = True
            unclaimed = []
            while not self._ready.empty():
                unclaimed.append(self._ready.get_nowait())
            self._ready.put(None)
        for channel in unclaimed:
            if channel is not None:
                channel.close()
        self._rt.post(self._held.clear, is_request=False)  # destroyed on the owner thread


def connect(rt: _Runtime, address: str, timeout: float) -> UcxxChannel:
    """A channel to the listener at `address`: connect, then send our channel id."""
    host, port = parse_address(address, "ucxx")
    endpoint, watch = rt.call(lambda: _watched(rt, rt.ucx.UCXEndpoint.create(rt.worker, host, port, True)),
                              timeout, f"connect to {address}")
    channel_id = secrets.randbits(62)
    hello = np.array([channel_id], np.uint64)
    array = rt.Array(hello)
    rt.wait(rt.post(lambda: endpoint.stream_send(array)), timeout, f"connect to {address}")
    return UcxxChannel(rt, endpoint, watch, channel_id, outbound=True, peer=address)


class UcxxBackend(Backend):
    name = "ucxx"

    def __init__(self, tls: str | None = None, poll_us: int = POLL_US_DEFAULT) -> None:
        """Raises BackendUnavailableError at once when ucxx cannot run here. `poll_us`: how long
        the owner thread keeps polling after the last event while operations are in flight (0:
        sleep on every event; less CPU, lower throughput)."""
        runtime(tls, poll_us)

    def listen(self, host: str, port: int) -> Listener:
        return UcxxListener(current_runtime(), host, port)

    def connect(self, address: str, timeout: float) -> Channel:
        return connect(current_runtime(), address, timeout)
