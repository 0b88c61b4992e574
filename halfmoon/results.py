"""What the SDK returns: results, stream chunks and model descriptions (frozen dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_prompt_tokens: int  # served from the KV cache, not computed
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Timings:
    """Server-side milliseconds: queue, prefill, KV transfer, time to first token, mean time
    per output token after the first, end to end."""

    queue_ms: float
    prefill_ms: float
    transfer_ms: float
    ttft_ms: float
    mean_tpot_ms: float
    e2e_ms: float


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """A finished generation. `finish_reason` is "stop", "length" or "abort"; `stop` is the
    stop string that ended it, if one did."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    stop: str | None
    usage: Usage
    timings: Timings


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """New tokens of a stream; the last chunk has `result` set (and may have no tokens)."""

    request_id: str
    token_ids: list[int]
    text: str
    result: GenerationResult | None = None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    id: str
    max_model_len: int
    vocab_size: int
    owned_by: str
