"""halfmoon.transport._ucxspin: the ucxx backend's native polling slice (transport/_ucxspin.c), and the
owner thread's use of it: polling while transfers are in flight, asleep when idle.

The shared suites (test_backends, test_faults, test_blocks) run every ucxx transfer through the
polling owner thread; here: the slice's contract on a worker of its own (in a subprocess), both polling
settings moving the same bytes, and an idle process that does not spin.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

from tests.transport.conftest import accept_pair, thread_cpu_s
from halfmoon.transport import get_backend
from halfmoon.transport import ucxx_runtime as ur

u = pytest.importorskip("ucxx._lib.libucxx", reason="ucxx is not installed")


@pytest.fixture(scope="module")
def spin() -> Any:
    """The extension. gcc and the Python headers are on every machine of this project (dev,
    CI): a missing one means the install broke and ucxx runs slower, so it fails."""
    try:
        from halfmoon.transport import _ucxspin
    except ImportError as e:
        pytest.fail(f"halfmoon.transport._ucxspin was not built by `pip install -e .`: {e}")
    return _ucxspin.spin


@pytest.fixture(scope="module")
def probe() -> dict[str, Any]:
    """The slice on a worker of its own, in a process of its own (tests/transport/ucxspin_probe.py)."""
    proc = subprocess.run([sys.executable, "-m", "tests.transport.ucxspin_probe"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_an_idle_worker_is_polled_for_the_budget_then_zero(probe: dict[str, Any]) -> None:
    assert probe["idle_events"] == 0
    assert 0.025 <= probe["idle_s"] < 2.0  # a 30 ms budget


def test_a_queued_post_ends_the_slice_at_once(probe: dict[str, Any]) -> None:
    assert probe["woken_events"] == 0 and probe["woken_s"] < 1.0  # of a 10 s budget


def test_events_are_counted_and_end_the_slice(probe: dict[str, Any]) -> None:
    """A connection to a listener of the same worker: the slices that saw it return > 0."""
    assert probe["accepted"] == 1 and probe["connect_events"] > 0


@pytest.mark.parametrize("args", [(0, 1, 0, 1000), (1, 0, 0, 1000), (1, 1, 0, -1)],
                         ids=["null function", "null worker", "negative budget"])
def test_bad_arguments_are_refused(spin: Any, args: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError, match="spin:"):
        spin(*args)


def test_the_backend_polls_natively() -> None:
    get_backend("ucxx")
    assert ur.current_runtime().polls_natively, "the ucxx runtime fell back to sleeping on events"


@pytest.mark.parametrize("poll_us", [0, ur.POLL_US_DEFAULT], ids=["sleep on events", "poll"])
def test_both_polling_settings_move_the_same_bytes(poll_us: int) -> None:
    backend = get_backend("ucxx", ucx_poll_us=poll_us)
    try:
        assert ur.current_runtime().poll_s == poll_us / 1e6
        rng = np.random.default_rng(poll_us)
        frames = [rng.integers(0, 256, n, dtype=np.uint8) for n in (8 << 20, 4096, 3 << 20)]
        got = _roundtrip(backend, frames)
        assert all(np.array_equal(a, b) for a, b in zip(frames, got))
    finally:
        get_backend("ucxx")  # the process-wide setting back to the default


def test_an_idle_process_does_not_spin() -> None:
    """As a decode worker between requests: a receive for the next message is posted, nothing
    comes. After the polling window the owner thread sleeps on UCX's event fd."""
    backend = get_backend("ucxx")
    pair = _pair(backend)
    sender, receiver, listener = pair
    try:
        _transfer(sender, receiver, [np.ones(8 << 20, np.uint8)])  # poll, then go idle
        buf = bytearray(64)
        receiver.post_recvs([[memoryview(buf)]])  # the next message, which never comes
        rt = ur.current_runtime()
        rt.call(lambda: None, 5.0, "sync")  # posts run in order: the receive is in flight now
        before = thread_cpu_s(rt.owner.native_id)
        time.sleep(1.0)  # the thing under test: the owner thread's CPU over an idle second
        used = thread_cpu_s(rt.owner.native_id) - before
    finally:
        _close(pair)
    assert used < 0.2, f"the idle UCX owner thread used {used:.2f} s of CPU in 1 s"


def test_a_negative_polling_time_is_refused() -> None:
    with pytest.raises(ValueError, match="poll_us"):
        ur.runtime(None, -1)


def _pair(backend: Any) -> tuple[Any, Any, Any]:
    listener = backend.listen("127.0.0.1", 0)
    return (*accept_pair(backend, listener), listener)


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
