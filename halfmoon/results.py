"""What the SDK returns: results, stream chunks and model descriptions (frozen dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass

# A generation's usage, server-side timings and admission's prediction have one shape on both
# sides of the API: the server's own (core.messages), re-exported here.
from halfmoon.core.messages import SloPrediction, Timings, TokenLogprobs, Usage

__all__ = ["AdapterInfo", "GenerationResult", "ModelInfo", "SloPrediction", "StreamChunk", "Timings", "TokenLogprobs",
           "Usage"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model made: `arguments` is JSON text of an object (`json.loads` it)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """A finished generation. `finish_reason` is "stop", "length", "abort" or "tool_calls" (it
    ended on its own after calling tools: `tool_calls`, with `content` the text before them); `stop` is the
    stop string that ended it, if one did; `prediction`: the TTFT / TBT admission predicted for
    it, next to its objectives (ms; 0 = no objective), or None where the server predicted none."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    stop: str | None
    usage: Usage
    timings: Timings
    prediction: SloPrediction | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.., when the request asked
    # n > 1: every choice in index order (choices[0] is this result's own text and tokens; each
    # choice's usage counts its own tokens, this result's the request's); n = 1: ()
    choices: tuple[GenerationResult, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()  # a request with tools: the calls found in `text`
    content: str | None = None  # with tool_calls: the text before them (else None: see `text`)


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """New tokens of a stream (of choice `index` when n > 1); the last chunk has `result` set
    (and may have no tokens)."""

    request_id: str
    token_ids: list[int]
    text: str
    result: GenerationResult | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked
    index: int = 0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A served model (`ListModels`, `/v1/models`); the server describes its model with it too."""

    id: str
    max_model_len: int
    vocab_size: int
    owned_by: str = "halfmoon"
    architecture: str = ""  # the model family: llama, mistral, qwen2, qwen3, gemma3
    dtype: str = ""  # compute / KV dtype, `+int8` / `+int4` with quantized weights
    parent: str = ""  # a LoRA adapter: its base model's id ("" for the base model)


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """A loaded LoRA adapter (the admin API: `load_adapter`, `unload_adapter`, `adapters`):
    requests name it as their `model`. `digest` identifies its weights; `load_ms` is what reading
    and checking it took the server; `loaded_at` is Unix seconds."""

    name: str
    path: str
    digest: str
    rank: int
    target_modules: tuple[str, ...]
    base_model: str
    load_ms: float
    loaded_at: float
