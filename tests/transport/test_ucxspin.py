"""transport._ucxspin: the ucxx backend's native polling slice (transport/_ucxspin.c), and the
owner thread's use of it: polling while transfers are in flight, asleep when idle.

The shared suites (test_backends, test_faults, test_blocks) run every ucxx transfer through the
polling owner thread; here: the slice's contract on a worker of the test's own, both polling
settings moving the same bytes, and an idle process that does not spin.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from transport import get_backend
from transport import ucxx_backend as ub

u = pytest.importorskip("ucxx._lib.libucxx", reason="ucxx is not installed")


@pytest.fixture(scope="module")
def spin() -> Any:
    """The extension. gcc and the Python headers are on every machine of this project (dev,
    CI): a missing one means the install broke and ucxx runs slower, so it fails."""
    try:
        from transport import _ucxspin
    except ImportError as e:
        pytest.fail(f"transport._ucxspin was not built by `pip install -e .`: {e}")
    return _ucxspin.spin


@pytest.fixture(scope="module")
def progress_fn() -> int:
    get_backend("ucxx")  # loads libucp through ucxx
    lib = ctypes.CDLL("libucp.so.0", mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    addr = ctypes.cast(lib.ucp_worker_progress, ctypes.c_void_p).value
    assert addr
    return addr


@pytest.fixture
def worker() -> Iterator[Any]:
    """A worker of the test's own (the runtime's belongs to its owner thread)."""
    context = u.UCXContext(feature_flags=(u.Feature.TAG, u.Feature.STREAM))
    yield u.UCXWorker(context)


@pytest.fixture
def wake() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    yield r, w
    os.close(r)
    os.close(w)


def test_an_idle_worker_is_polled_for_the_budget_then_zero(spin: Any, progress_fn: int, worker: Any,
                                                             wake: tuple[int, int]) -> None:
    start = time.perf_counter()
    assert spin(progress_fn, worker.handle, wake[0], 30_000_000) == 0
    assert 0.025 <= time.perf_counter() - start < 2.0


def test_a_queued_post_ends_the_slice_at_once(spin: Any, progress_fn: int, worker: Any,
                                               wake: tuple[int, int]) -> None:
    os.write(wake[1], b"x")
    start = time.perf_counter()
    assert spin(progress_fn, worker.handle, wake[0], 10_000_000_000) == 0  # a 10 s budget
    assert time.perf_counter() - start < 1.0


def test_events_are_counted_and_end_the_slice(spin: Any, progress_fn: int, worker: Any,
                                               wake: tuple[int, int]) -> None:
    """A connection to a listener of the same worker: the slices that saw it return > 0."""
    accepted: list[Any] = []
    listener = u.UCXListener.create(
        worker, 0, lambda request: accepted.append(listener.create_endpoint_from_conn_request(request, True)))
    endpoint = u.UCXEndpoint.create(worker, "127.0.0.1", listener.port, True)  # noqa: F841 (kept alive)
    events, deadline = 0, time.monotonic() + 10.0
    while not accepted and time.monotonic() < deadline:
        events += spin(progress_fn, worker.handle, wake[0], 100_000_000)
    assert accepted and events > 0


@pytest.mark.parametrize("args", [(0, 1, 0, 1000), (1, 0, 0, 1000), (1, 1, 0, -1)],
                         ids=["null function", "null worker", "negative budget"])
def test_bad_arguments_are_refused(spin: Any, args: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError, match="spin:"):
        spin(*args)


def test_the_backend_polls_natively() -> None:
    backend = get_backend("ucxx")
    assert backend._rt._poll_slice is not None, "the ucxx runtime fell back to sleeping on events"


@pytest.mark.parametrize("poll_us", [0, ub.POLL_US_DEFAULT], ids=["sleep on events", "poll"])
def test_both_polling_settings_move_the_same_bytes(poll_us: int) -> None:
    backend = get_backend("ucxx", ucx_poll_us=poll_us)
    try:
        assert backend._rt.poll_s == poll_us / 1e6
        rng = np.random.default_rng(poll_us)
        frames = [rng.integers(0, 256, n, dtype=np.uint8) for n in (8 << 20, 4096, 3 << 20)]
        got = _roundtrip(backend, frames)
        assert all(np.array_equal(a, b) for a, b in zip(frames, got))
    finally:
        get_backend("ucxx")  # the process-wide setting back to the default


def test_an_idle_process_does_not_spin() -> None:
    """As a decode worker between requests: a receive for the next header is posted, nothing
    comes. After the polling window the owner thread sleeps on UCX's event fd."""
    backend = get_backend("ucxx")
    pair = _pair(backend)
    sender, receiver, listener = pair
    try:
        _transfer(sender, receiver, [np.ones(8 << 20, np.uint8)])  # poll, then go idle
        waiting = threading.Thread(target=_recv_nothing, args=(receiver,), daemon=True)
        waiting.start()
        time.sleep(0.2)
        owner = next(t for t in threading.enumerate() if t.name == "ucx-owner")
        before = _thread_cpu_s(owner.native_id)
        time.sleep(1.0)
        used = _thread_cpu_s(owner.native_id) - before
    finally:
        _close(pair)
    assert used < 0.2, f"the idle UCX owner thread used {used:.2f} s of CPU in 1 s"


def _recv_nothing(receiver: Any) -> None:
    try:
        receiver.recv_into([memoryview(bytearray(64))], 30.0)
    except Exception:  # the channel closes under it at the end of the test
        pass


def test_a_negative_polling_time_is_refused() -> None:
    with pytest.raises(ValueError, match="poll_us"):
        ub.runtime(None, -1)


def _pair(backend: Any) -> tuple[Any, Any, Any]:
    listener = backend.listen("127.0.0.1", 0)
    accepted: list[Any] = []
    t = threading.Thread(target=lambda: accepted.append(listener.accept(10.0)))
    t.start()
    sender = backend.connect(listener.address, 10.0)
    t.join(10.0)
    assert accepted and accepted[0] is not None
    return sender, accepted[0], listener


def _close(pair: tuple[Any, Any, Any]) -> None:
    for end in pair:
        end.close()


def _roundtrip(backend: Any, frames: list[np.ndarray]) -> list[np.ndarray]:
    pair = _pair(backend)
    try:
        return _transfer(pair[0], pair[1], frames)
    finally:
        _close(pair)


def _transfer(sender: Any, receiver: Any, frames: list[np.ndarray]) -> list[np.ndarray]:
    out = [np.zeros_like(f) for f in frames]
    done = threading.Thread(target=lambda: receiver.recv_many([[memoryview(o)] for o in out], 10.0))
    done.start()
    sender.send_many([[memoryview(f)] for f in frames], 10.0)
    done.join(10.0)
    assert not done.is_alive()
    return out


def _thread_cpu_s(tid: int) -> float:
    fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
