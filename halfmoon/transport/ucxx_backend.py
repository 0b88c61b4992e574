"""UCX backend through `ucxx` (the maintained successor of ucx-py), on its low-level API.

UCX picks the transport per peer (shared memory on one host, TCP or RDMA between hosts);
`UCX_TLS` restricts the choice and is configurable (`UcxxBackend(tls=...)` or the environment).

The backend is four parts, one job each:

    ucxx_runtime   the process's UCX context and worker, and the one thread that owns them
                   (runs posted calls, progresses the worker, finishes each operation)
    ucxx_channel   a channel: tagged messages on one endpoint, control and data lanes
    ucxx_listener  accepts connections and greets each new peer on a thread of its own
    ucxx_recovery  checks the worker when a peer goes, replaces it if a dead peer wedged it

This module wires them (the runtime's `on_peer_lost` is the recovery's `watch`) and is the
entry point: `UcxxBackend`, what `transport.get_backend("ucxx")` returns.
"""

from __future__ import annotations

from halfmoon.transport import ucxx_recovery
from halfmoon.transport.channel import Backend, Channel, Listener
from halfmoon.transport.ucxx_channel import connect
from halfmoon.transport.ucxx_listener import UcxxListener
from halfmoon.transport.ucxx_runtime import POLL_US_DEFAULT, UCX_ENV_DEFAULTS, current_runtime, runtime

__all__ = ["POLL_US_DEFAULT", "UCX_ENV_DEFAULTS", "UcxxBackend"]


class UcxxBackend(Backend):
    name = "ucxx"

    def __init__(self, tls: str | None = None, poll_us: int = POLL_US_DEFAULT) -> None:
        """Raises BackendUnavailableError at once when ucxx cannot run here. `poll_us`: how long
        the owner thread keeps polling after the last event while operations are in flight (0:
        sleep on every event; less CPU, lower throughput)."""
        runtime(tls, poll_us, on_peer_lost=ucxx_recovery.watch)

    def listen(self, host: str, port: int) -> Listener:
        return UcxxListener(current_runtime(), host, port)

    def connect(self, address: str, timeout: float) -> Channel:
        return connect(current_runtime(), address, timeout)
