"""The base errors every room raises or maps.

`HalfmoonError` is the root of every error Halfmoon raises on purpose; the API layer maps each
class to exactly one gRPC status / HTTP code (conductor/errors.py). Room-specific errors subclass
these in their own package (engine/errors.py, kvpool/errors.py, transport/errors.py, ...).
"""

from __future__ import annotations


class HalfmoonError(Exception):
    """Base of every error Halfmoon raises on purpose."""


class InvalidRequestError(HalfmoonError, ValueError):
    """A request parameter is invalid; `field` names it so a client can fix it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ConfigError(HalfmoonError, ValueError):
    """A configuration value is invalid."""
