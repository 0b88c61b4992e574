"""Precise exception types raised inside the engine.

The API layer maps each class to exactly one gRPC status / HTTP code; internal code never raises
bare `Exception` or `ValueError` for a user mistake.
"""

from __future__ import annotations

from halfmoon.core.errors import HalfmoonError


class ModelLoadError(HalfmoonError):
    """The model could not be found or read (unknown path, corrupt or truncated file)."""


class UnsupportedModelError(ModelLoadError):
    """The model file is readable but its architecture or tensor types are not supported."""


class RequestAbortedError(HalfmoonError):
    """The request was cancelled by its client."""


class TokenizerError(HalfmoonError):
    """The tokenizer could not be built or used."""


class ChatTemplateError(TokenizerError):
    """The chat template is missing or the messages do not fit it."""


class UnsupportedTokenizerError(TokenizerError):
    """The tokenizer kind (GGUF model or pre-tokenizer type) is not one Halfmoon can build."""


class ShardingError(HalfmoonError):
    """The model cannot be split over the asked tensor-parallel size (heads, groups, sizes)."""


class CollectiveInitError(HalfmoonError):
    """A tensor-parallel group could not start: its rendezvous, its gloo / NCCL process group, or a
    rank that died or failed while loading (the message names it)."""


class RankLostError(HalfmoonError):
    """A tensor-parallel rank died or stopped answering during a step: the engine cannot go on."""
