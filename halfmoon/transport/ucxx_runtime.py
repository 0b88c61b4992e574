"""The process's UCX runtime: the context, the worker and the one thread that owns them.

UCX picks the transport per peer (shared memory on one host, TCP or RDMA between hosts);
`UCX_TLS` restricts the choice and is configurable (`UcxxBackend(tls=...)` or the environment).

One thread per process owns the UCX worker (a UCX worker is single-threaded): it runs the posts
other threads queue, progresses the worker, and finishes each completed operation (`Op`). While
operations are in flight and events keep coming it polls the worker in C without the GIL
(transport/_ucxspin.c), for up to `poll_s` after the last event: UCX moves a large message in
fragments that each need both ends progressed, and a wake-up per fragment costs about half the
shared-memory throughput. Otherwise it sleeps in `select` on the worker's event fd and a wake-up
pipe (UCX's arm / wait pattern), so an idle process does not spin. A waiting thread blocks on its
operation with its timeout. (ucxx's asyncio API was measured first: a hand-off per operation
through its loop and awaits that spin for the GIL held transfers to 0.3-0.6x of `ucx_perftest`.)

The runtime knows the listeners and channels that live on its worker (`adopt_listener`,
`adopt_channel`) only through the verbs a replacement needs (`replace_runtime`: listeners
`move_to` the new worker, channels `close`); what checks the worker when a peer goes is given
to it (`on_peer_lost`: transport.ucxx_recovery.watch, wired by transport.ucxx_backend).
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from halfmoon.transport.errors import BackendUnavailableError, PeerLostError, TransferTimeoutError

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
POLL_US_DEFAULT = 2000  # keep polling this long after the last event (TransportConfig.ucx_poll_us)
POLL_SLICE_NS = 200_000  # one native polling slice; between slices the owner reaps in Python
RETIRED_TICK_S = 0.1  # how often a replaced runtime's owner thread looks for posts


class Op:
    """One posted UCX operation, finished once by the owner thread (`finish`).

    Completion is a lock held from creation and released by `finish`: a wait or a check is one
    C call, where a threading.Event costs a dozen Python frames on each side, several times per
    transfer unit."""

    __slots__ = ("_done", "_pending", "error", "request", "result")

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


class MovableListener(Protocol):
    """What a replacement needs of a listener on the old worker (transport.ucxx_listener)."""

    def move_to(self, rt: UcxRuntime) -> None: ...


class ClosableChannel(Protocol):
    """What a replacement needs of a channel on the old worker (transport.ucxx_channel)."""

    def close(self) -> None: ...


PeerLostHook = Callable[["UcxRuntime"], None]


class UcxRuntime:
    """The process's UCX context and worker, and the thread that owns them.

    Any thread: `post` / `post_all` / `call` / `wait`. Only the owner thread creates, uses and
    destroys ucxx objects (a ucxx destructor racing the worker's progress crashes)."""

    def __init__(self, tls: str | None, poll_us: int, on_peer_lost: PeerLostHook | None = None) -> None:
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
        # What lives on this worker, so a replacement (replace_runtime) can move it.
        self._members_lock = threading.Lock()
        self._listeners: weakref.WeakSet[MovableListener] = weakref.WeakSet()
        self._channels: weakref.WeakSet[ClosableChannel] = weakref.WeakSet()
        self.on_peer_lost = on_peer_lost  # called (owner thread) after `suspect` is set
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
        """Run `fn` on the owner thread and return what it returned (raises as `wait`)."""
        return self.wait(self.post(fn, is_request=False), timeout, what).result

    def wait(self, op: Op, timeout: float | None, what: str) -> Op:
        """`op`, once finished: TransferTimeoutError after `timeout` seconds, PeerLostError if
        it failed (`what` names the operation in the message)."""
        if not op.wait(timeout):
            raise TransferTimeoutError(f"{what} made no progress for {timeout:.1f}s")
        if op.error is not None:
            raise PeerLostError(f"{what} failed: {op.error}") from op.error
        return op

    def adopt_listener(self, listener: MovableListener) -> None:
        """`listener` lives on this worker: a replacement moves it (weakly held)."""
        with self._members_lock:
            self._listeners.add(listener)

    def adopt_channel(self, channel: ClosableChannel) -> None:
        """`channel` lives on this worker: a replacement closes it (weakly held)."""
        with self._members_lock:
            self._channels.add(channel)

    def members(self) -> tuple[list[MovableListener], list[ClosableChannel]]:
        """The listeners and channels living on this worker (a snapshot)."""
        with self._members_lock:
            return list(self._listeners), list(self._channels)

    def peer_lost(self) -> None:
        """A peer closed (or lost) an endpoint of this worker: have it checked. On the owner
        thread, so it only sets an event and calls `on_peer_lost`, which must not block
        (transport.ucxx_recovery.watch: starts this worker's checker once)."""
        self.suspect.set()
        if self.on_peer_lost is not None:
            self.on_peer_lost(self)

    @property
    def polls_natively(self) -> bool:
        """True when the owner thread polls in C while operations are in flight (else it
        sleeps on every UCX event: transport._ucxspin did not load)."""
        return self._poll_slice is not None

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
        from halfmoon.transport import _ucxspin

        progress = ucp_progress_address()
    except (ImportError, OSError, AttributeError) as e:
        log.warning("the ucxx backend runs without its native polling loop (%s): its owner thread "
                    "sleeps on UCX events between fragments, ~0.7x the shared-memory throughput; "
                    "build it with a C compiler and `pip install -e .`", e)
        return None
    handle, spin = worker.handle, _ucxspin.spin
    return lambda: spin(progress, handle, wake_fd, POLL_SLICE_NS)


_runtime: UcxRuntime | None = None  # UCX's context is per process, so is its runtime
_runtime_lock = threading.Lock()


def current_runtime() -> UcxRuntime:
    """The runtime new connections and listeners use (after a replacement, the new one)."""
    if _runtime is None:
        raise RuntimeError("the UCX runtime was not started (create a UcxxBackend first)")
    return _runtime


def replace_runtime(old: UcxRuntime) -> UcxRuntime:
    """Start a new runtime (context, worker, owner thread) in place of `old`, move `old`'s
    listeners to it on their own ports and close `old`'s channels (their waiters get
    PeerLostError; senders reconnect). `old` is kept, idle, so nothing it owns is freed under
    a pending operation. Returns the new runtime."""
    global _runtime
    with _runtime_lock:
        if _runtime is not old:
            return current_runtime()  # already replaced
        new = _runtime = UcxRuntime(old.tls, round(old.poll_s * 1e6), old.on_peer_lost)
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


_retired: list[UcxRuntime] = []  # replaced runtimes: never destroyed (see replace_runtime)


def runtime(tls: str | None, poll_us: int = POLL_US_DEFAULT, on_peer_lost: PeerLostHook | None = None) -> UcxRuntime:
    """The process's UCX runtime, started on first use. `poll_us` applies to the whole process
    (the last backend created sets it); so does `on_peer_lost` when given (it passes on to
    replacements)."""
    global _runtime
    if poll_us < 0:
        raise ValueError(f"poll_us must be >= 0, got {poll_us}")
    with _runtime_lock:
        if _runtime is None:
            _runtime = UcxRuntime(tls, poll_us, on_peer_lost)
        elif tls is not None and tls != _runtime.tls:
            raise BackendUnavailableError(
                "ucxx", f"UCX is already running with UCX_TLS={_runtime.tls!r} in this process; "
                f"cannot switch to {tls!r}")
        _runtime.poll_s = poll_us / 1e6
        if on_peer_lost is not None:
            _runtime.on_peer_lost = on_peer_lost
        return _runtime

