"""Precise exception types raised by the KV transport.

Every class pickles back to itself (Ray ships exceptions between actors): the ones that carry
fields are `core.errors.StructuredError`s.
"""

from __future__ import annotations

from halfmoon.core.errors import StructuredError


class TransportError(Exception):
    """Base of every error the transport raises on purpose."""


class BackendUnavailableError(StructuredError, TransportError):
    """The configured backend cannot be used here (e.g. `ucxx` does not import). Raised at
    startup: the transport never falls back to another backend silently."""

    backend: str
    reason: str
    fields = ("backend", "reason")
    template = "transport backend {backend!r} is unavailable: {reason}"


class HandshakeError(StructuredError, TransportError):
    """The peer refused the connection (or we refused it): `field` names what differs —
    "version", "secret", "fingerprint", "num_layers", "block_size", "num_kv_heads", "head_dim",
    "dtype", "windows", "tp", "kv_head_start" — or "protocol" for a peer that does not speak it at all."""

    field: str
    message: str
    fields = ("field", "message")
    template = "handshake refused ({field}): {message}"


class PeerLostError(TransportError):
    """The connection broke (peer died, reset, closed) before the operation completed."""


class TransferTimeoutError(TransportError, TimeoutError):
    """A wait ran past its timeout (connect, send, backpressure, or a transfer's completion)."""


class ChecksumError(StructuredError, TransportError):
    """A transfer unit's bytes did not match the sender's checksum; the data was not used."""

    request_id: str
    layer: int
    expected: int
    actual: int
    fields = ("request_id", "layer", "expected", "actual")
    template = "request {request_id!r} layer {layer}: checksum mismatch (sent {expected:#018x}, received {actual:#018x}); the data was discarded"


class TransferCancelledError(TransportError):
    """The transfer was cancelled (by either side) before it completed."""


class ProtocolError(TransportError):
    """The peer sent something the protocol does not allow (unknown request, blocks it did not
    reserve, a unit after completion, an oversized frame)."""
