"""Transport configuration: frozen, typed, validated once (CLI / YAML / Helm values -> here).

The shared secret never travels in a config file or on a command line in plain text: it comes
from a file (`secret_file`, e.g. a mounted Kubernetes Secret) or from `HALFMOON_KV_SECRET`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from halfmoon.core.errors import check_positive
from halfmoon.transport.channel import BACKENDS, Backend, get_backend
from halfmoon.transport.errors import TransportError

SECRET_ENV = "HALFMOON_KV_SECRET"


class TransportConfigError(TransportError, ValueError):
    """A transport setting is invalid; the message names the field."""


@dataclass(frozen=True, slots=True)
class TransportConfig:
    """How this worker moves KV blocks.

    backend: `auto` (ucxx when it imports, else tcp with a warning), `ucxx`, `tcp` or `local`.
        A backend named explicitly that cannot run fails at startup (BackendUnavailableError).
    ucx_tls: UCX_TLS for the ucxx backend (e.g. `tcp`, `sm,tcp,self`, `rc,sm,self`); None = UCX's
        own choice / the environment.
    ucx_poll_us: for the ucxx backend, how long its UCX thread keeps polling the worker (in C,
        without the GIL) after the last event while transfers are in flight; 0 = sleep on every
        event: less CPU during transfers, ~0.7x the shared-memory throughput.
    host / port: where the receiver (decode side) listens; port 0 = any free port.
    secret_file: file holding the shared secret both ends must present (HMAC challenge); None =
        `HALFMOON_KV_SECRET` if set, else no secret.
    timeout_s: bound on every wait (connect, handshake, a frame, backpressure, completion).
    max_inflight_mb: per peer, bytes queued or being sent; a slow receiver makes the prefill
        wait instead of growing memory.
    """

    backend: str = "auto"
    ucx_tls: str | None = None
    ucx_poll_us: int = 2000
    host: str = "127.0.0.1"
    port: int = 0
    secret_file: str | None = None
    timeout_s: float = 30.0
    max_inflight_mb: int = 256

    def __post_init__(self) -> None:
        if self.backend not in (*BACKENDS, "auto"):
            raise TransportConfigError(f"backend {self.backend!r}: choose one of auto, {', '.join(BACKENDS)}")
        if not 0 <= self.port <= 65535:
            raise TransportConfigError(f"port {self.port} is not in 0..65535")
        check_positive(self, "timeout_s", "max_inflight_mb", error=TransportConfigError)
        if self.ucx_poll_us < 0:
            raise TransportConfigError(f"ucx_poll_us must be >= 0, got {self.ucx_poll_us}")
        if self.ucx_tls is not None and self.backend not in ("ucxx", "auto"):
            raise TransportConfigError(f"ucx_tls is set but the backend is {self.backend!r}")

    @property
    def max_inflight_bytes(self) -> int:
        return self.max_inflight_mb << 20

    def secret(self) -> bytes | None:
        """The shared secret from `secret_file`, else the environment, else None."""
        if self.secret_file is not None:
            try:
                data = Path(self.secret_file).read_bytes().strip()
            except OSError as e:
                raise TransportConfigError(f"secret_file {self.secret_file!r}: {e.strerror}") from e
            if not data:
                raise TransportConfigError(f"secret_file {self.secret_file!r} is empty")
            return data
        env = os.environ.get(SECRET_ENV)
        return env.encode() if env else None

    def make_backend(self) -> Backend:
        """The configured backend, or BackendUnavailableError right now (never a silent fallback)."""
        return get_backend(self.backend, ucx_tls=self.ucx_tls, ucx_poll_us=self.ucx_poll_us)


def advertised_address(bound: str, host: str) -> str:
    """The address other workers should dial: a wildcard bind (0.0.0.0 / ::, for pods and
    multi-node clusters) is replaced by this node's IP as Ray (else the resolver) knows it."""
    if host not in ("0.0.0.0", "::", ""):
        return bound
    port = bound.rsplit(":", 1)[1]
    try:
        import ray

        ip = ray.util.get_node_ip_address()
    except Exception:  # not inside Ray: ask the resolver
        import socket

        ip = socket.gethostbyname(socket.gethostname())
    return f"{ip}:{port}"
