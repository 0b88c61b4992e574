"""Precise exception types raised by the KV transport.

Every class pickles back to itself (Ray ships exceptions between actors), so the ones that carry
fields define `__reduce__`.
"""

from __future__ import annotations


class TransportError(Exception):
    """Base of every error the transport raises on purpose."""


class BackendUnavailableError(TransportError):
    """The configured backend cannot be used here (e.g. `ucxx` does not import). Raised at
    startup: the transport never falls back to another backend silently."""

    def __init__(self, backend: str, reason: str) -> None:
        super().__init__(f"transport backend {backend!r} is unavailable: {reason}")
        self.backend = backend
        self.reason = reason

    def __reduce__(self) -> tuple[type[BackendUnavailableError], tuple[str, str]]:
        return (type(self), (self.backend, self.reason))


class HandshakeError(TransportError):
    """The peer refused the connection (or we refused it): `field` names what differs —
    "version", "secret", "fingerprint", "num_layers", "block_size", "num_kv_heads", "head_dim",
    "dtype" — or "protocol" for a peer that does not speak it at all."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"handshake refused ({field}): {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[type[HandshakeError], tuple[str, str]]:
        return (type(self), (self.field, self.message))


class PeerLostError(TransportError):
    """The connection broke (peer died, reset, closed) before the operation completed."""


class TransferTimeoutError(TransportError, TimeoutError):
    """A wait ran past its timeout (connect, send, backpressure, or a transfer's completion)."""


class ChecksumError(TransportError):
    """A transfer unit's bytes did not match the sender's checksum; the data was not used."""

    def __init__(self, request_id: str, layer: int, expected: int, actual: int) -> None:
        super().__init__(f"request {request_id!r} layer {layer}: checksum mismatch "
                         f"(sent {expected:#018x}, received {actual:#018x}); the data was discarded")
        self.request_id = request_id
        self.layer = layer
        self.expected = expected
        self.actual = actual

    def __reduce__(self) -> tuple[type[ChecksumError], tuple[str, int, int, int]]:
        return (type(self), (self.request_id, self.layer, self.expected, self.actual))


class TransferCancelledError(TransportError):
    """The transfer was cancelled (by either side) before it completed."""


class ProtocolError(TransportError):
    """The peer sent something the protocol does not allow (unknown request, blocks it did not
    reserve, a unit after completion, an oversized frame)."""
