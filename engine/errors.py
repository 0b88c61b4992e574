"""Precise exception types raised inside the engine.

The API layer maps each class to exactly one gRPC status / HTTP code; internal code never raises
bare `Exception` or `ValueError` for a user mistake.
"""

from __future__ import annotations


class HalfmoonError(Exception):
    """Base of every error Halfmoon raises on purpose."""


class ModelLoadError(HalfmoonError):
    """The model could not be found or read (unknown path, corrupt or truncated file)."""


class UnsupportedModelError(ModelLoadError):
    """The model file is readable but its architecture or tensor types are not supported."""


class InvalidRequestError(HalfmoonError, ValueError):
    """A request parameter is invalid; `field` names it so a client can fix it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ConfigError(HalfmoonError, ValueError):
    """An engine/cluster configuration value is invalid."""


class RequestAbortedError(HalfmoonError):
    """The request was cancelled by its client."""


class TokenizerError(HalfmoonError):
    """The tokenizer could not be built or used."""


class ChatTemplateError(TokenizerError):
    """The chat template is missing or the messages do not fit it."""


class UnsupportedTokenizerError(TokenizerError):
    """The tokenizer kind (GGUF model or pre-tokenizer type) is not one Halfmoon can build."""
