"""Replacing the UCX worker when a dead peer has wedged its shared-memory receive queue.

UCX's shared-memory transports (sysv, posix) deliver into a FIFO in the receiver's shared memory.
A sender claims a slot (an atomic bump of the FIFO head), writes the message into it, then flips
the slot's owner bit; the receiver reads slots in order and waits for each bit. A sender killed
between the two steps (a prefill worker OOM-killed in the middle of a transfer) leaves a slot that
is never completed, and UCX cannot skip it: from then on nothing sent over shared memory reaches
this worker, from any peer. (Found in tests/transport/test_faults.py: after a sender was killed
mid-transfer, about one run in four, every later connection's greeting timed out.)

So whenever a peer closes or loses an endpoint of this process's worker, a doctor thread checks
the worker: it connects to itself through a fresh listener (the transports a peer on this host
would use) and waits for the greeting. If the greeting does not arrive within PROBE_TIMEOUT_S,
the doctor logs an error and replaces the runtime (`ucxx_runtime.replace_runtime`): a new worker,
the listeners moved to it on their own ports, the old channels closed (their waiters get
PeerLostError; senders reconnect through their endpoint cache).

A runtime calls `watch` when a peer goes because the backend gives it as the runtime's
`on_peer_lost` (transport.ucxx_backend); the runtime itself knows nothing of this module.
"""

from __future__ import annotations

import logging
import threading
import time

from halfmoon.transport.errors import TransportError
from halfmoon.transport.ucxx_channel import connect
from halfmoon.transport.ucxx_listener import UcxxListener
from halfmoon.transport.ucxx_runtime import UcxRuntime, current_runtime, replace_runtime

log = logging.getLogger("halfmoon.transport")
PROBE_DELAY_S = 0.2  # let a failure settle first: several endpoints often go at once
PROBE_TIMEOUT_S = 3.0  # a healthy worker greets itself in milliseconds

_checking_lock = threading.Lock()
_checking = 0  # checks (probe, and replacement if needed) in progress, over all runtimes


def watch(rt: UcxRuntime) -> None:
    """Make sure a doctor thread checks `rt` whenever `rt.suspect` is set. Cheap and
    non-blocking; only `rt`'s owner thread calls it, so one doctor is started per runtime."""
    if rt.doctor is None:
        rt.doctor = threading.Thread(target=_doctor, args=(rt,), name="ucx-doctor", daemon=True)
        rt.doctor.start()


def _doctor(rt: UcxRuntime) -> None:
    global _checking
    while not rt.retired:
        rt.suspect.wait()
        with _checking_lock:
            _checking += 1
        try:
            _check(rt)
        finally:
            with _checking_lock:
                _checking -= 1


def _check(rt: UcxRuntime) -> None:
    time.sleep(PROBE_DELAY_S)
    rt.suspect.clear()
    if rt.retired or probe(rt):
        return
    log.error("the UCX worker no longer receives from new peers: a peer that died while writing "
              "into its shared-memory queue left it blocked for good (a UCX limitation). "
              "Replacing the worker: open UCX channels of this process are closed (senders "
              "reconnect), listeners keep their addresses")
    try:
        replace_runtime(rt)
    except Exception:  # nothing else would report it: this is a daemon thread
        log.exception("replacing the wedged UCX worker failed; restart this process")


def settled(timeout: float) -> bool:
    """Wait until the current runtime has no check pending or running (tests, and callers
    that just lost a peer and want a usable worker before they reconnect)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not current_runtime().suspect.is_set() and _checking == 0:
            return True
        time.sleep(0.05)
    return False


def probe(rt: UcxRuntime, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """True if a new peer on this host can still reach `rt`'s worker: a connection to itself,
    through a listener of its own, completes its greeting within `timeout`."""
    listener = UcxxListener(rt, "127.0.0.1", 0, greet_timeout=timeout)
    accepted: list = []
    greeter = threading.Thread(target=lambda: accepted.append(listener.accept(timeout)), name="ucx-probe",
                               daemon=True)
    greeter.start()
    channels = []
    try:
        channels.append(connect(rt, listener.address, timeout))
        greeter.join(2 * timeout)
        channels += [c for c in accepted if c is not None]
        return len(channels) == 2
    except TransportError as e:
        log.debug("UCX self-probe failed: %s", e)
        return False
    finally:
        listener.close()
        for channel in channels:  # first: closing one end must not look like a lost peer
            channel.expect_close()
        for channel in channels:
            channel.close()
