"""One validation path for both APIs: a `RequestSpec` (what the client asked, already typed by
its API's parser) becomes a `GenerationInput` (token ids + checked parameters), or a precise
error naming the field as that client spelled it. What the backend can never serve is refused
here too: a priority class it does not have, a request whose KV (prompt + max_tokens) is larger
than a decode worker's whole cache."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from halfmoon.api.chat import render
from halfmoon.api.tool_formats import ToolFormat, token_literal
from halfmoon.api.tools import ToolRequest
from halfmoon.conductor.adapters import AdapterRegistry
from halfmoon.conductor.backend import GenerationInput, Slo
from halfmoon.conductor.errors import ModelNotFoundError
from halfmoon.core.adapters import AdapterRef
from halfmoon.core.errors import InvalidRequestError, check_positive
from halfmoon.core.params import Constraint, ConstraintKind, SamplingParams, check_token_ids
from halfmoon.engine.tokenizer import Tokenizer
from halfmoon.results import ModelInfo

ROLES = frozenset({"system", "user", "assistant", "tool"})
DEFAULT_MAX_TOKENS = 16
MAX_LOGIT_BIAS = 300  # entries of a request's logit_bias (OpenAI's limit)


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-request limits of the front door; every violation is a clear error.

    max_prompt_tokens: longest prompt accepted (also bounded by the model's context).
    max_tokens: largest `max_tokens` a request may ask for.
    max_request_bytes: largest request body / gRPC message.
    max_streams_per_client: requests one client (bearer token, else peer address) may have in
        flight at once.
    max_stop: most stop strings (and, separately, stop token ids) per request.
    max_messages: most chat messages per request.
    """

    max_prompt_tokens: int = 8192
    max_tokens: int = 4096
    max_request_bytes: int = 4 * 2**20
    max_streams_per_client: int = 128
    max_stop: int = 16
    max_stop_chars: int = 256
    max_messages: int = 256
    max_id_chars: int = 128

    def __post_init__(self) -> None:
        check_positive(self, "max_prompt_tokens", "max_tokens", "max_request_bytes", "max_streams_per_client",
                       "max_stop", "max_stop_chars", "max_messages", "max_id_chars")


@dataclass(slots=True)
class RequestSpec:
    """A request as its client sent it. `names` maps canonical field names to the client's
    spelling (e.g. `temperature` -> `sampling.temperature` in gRPC) so errors name its field."""

    model: str = ""
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    speculative: bool = True  # False: opt out of speculative decoding
    ttft_ms: float | None = None
    tbt_ms: float | None = None
    priority: int = 0
    priority_class: str | None = None  # None or "" = the server's default class
    cache_salt: str | None = None
    request_id: str | None = None
    deadline: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int | None = None
    logprobs: int | None = None  # None = none; k = the sampled token's and the top k
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (gRPC; HTTP: echo + logprobs)
    echo: bool = False  # completions: the answer starts with the prompt (and its logprobs)
    n: int = 1  # choices from one prefill
    constraint: Constraint | None = None  # structured output (api/structured.py)
    tools: ToolRequest | None = None  # chat's tools and tool_choice (api/tools.py)
    tool_format: ToolFormat | None = None  # how the served model writes calls (the front door's)
    names: Mapping[str, str] = field(default_factory=dict)

    def name(self, canonical: str) -> str:
        return self.names.get(canonical, canonical)


def check_model(model: str, card: ModelInfo, adapters: AdapterRegistry | None = None) -> AdapterRef | None:
    """Empty = the served model; anything else must be its id or a loaded LoRA adapter's name
    (returned; counted as one of its requests). ModelNotFoundError otherwise."""
    if adapters is not None:
        return adapters.resolve(model)
    if model and model != card.id:
        raise ModelNotFoundError(model, [card.id])
    return None


def build_input(spec: RequestSpec, tokenizer: Tokenizer, card: ModelInfo, limits: Limits, *,
                priority_classes: frozenset[str], kv_capacity_tokens: int | None = None,
                adapters: AdapterRegistry | None = None) -> GenerationInput:
    """Validate everything, tokenize, return what the backend runs. Raises InvalidRequestError
    (naming the field), ModelNotFoundError.

    priority_classes: the classes the backend has; kv_capacity_tokens: the most tokens (prompt +
    max_tokens) one request's KV may take where it decodes (None = not known: not checked here);
    adapters: the LoRA adapters a request's `model` may name (None: the base model only).
    """
    adapter = check_model(spec.model, card, adapters)
    cls = priority_class(spec, priority_classes)
    ids = prompt_ids(spec, tokenizer, card, limits)
    tool_constraint(spec, tokenizer)
    params = sampling_params(spec, card, limits, len(ids), kv_capacity_tokens, tokenizer)
    if adapter is not None:
        params = replace(params, adapter=adapter)
    check_kv_capacity(spec, len(ids), params.max_tokens, kv_capacity_tokens)
    return GenerationInput(ids, params, _short(spec, "request_id", spec.request_id, limits),
                           _short(spec, "cache_salt", spec.cache_salt, limits), slo(spec),
                           spec.priority, spec.deadline, priority_class=cls)


def priority_class(spec: RequestSpec, classes: frozenset[str]) -> str | None:
    """The class the request named (None: it named none, the backend's default applies)."""
    if not spec.priority_class:
        return None
    if spec.priority_class not in classes:
        raise InvalidRequestError(spec.name("priority_class"),
                                  f"{spec.priority_class!r} is not a priority class; one of {sorted(classes)}")
    return spec.priority_class


def check_kv_capacity(spec: RequestSpec, prompt_len: int, max_tokens: int, capacity: int | None) -> None:
    """A request whose KV could never fit a decode worker is refused now, not queued forever."""
    if capacity is None or prompt_len + max_tokens <= capacity:
        return
    if prompt_len >= capacity:  # not even one output token fits
        key = next(k for k in ("prompt", "messages", "prompt_token_ids") if getattr(spec, k) is not None)
        raise InvalidRequestError(spec.name(key), f"{prompt_len} tokens leave no room for output in a decode "
                                  f"worker's KV cache of {capacity} tokens (prompt + max_tokens must fit)")
    raise InvalidRequestError(spec.name("max_tokens"), f"{max_tokens} + {prompt_len} prompt tokens is over a "
                              f"decode worker's KV cache of {capacity} tokens; at most {capacity - prompt_len}")


def prompt_ids(spec: RequestSpec, tokenizer: Tokenizer, card: ModelInfo, limits: Limits) -> list[int]:
    given = [k for k, v in (("prompt", spec.prompt), ("messages", spec.messages),
                            ("prompt_token_ids", spec.prompt_token_ids)) if v is not None]
    if len(given) != 1:
        names = ", ".join(spec.name(k) for k in ("prompt", "messages", "prompt_token_ids"))
        what = "none" if not given else " and ".join(spec.name(k) for k in given)
        raise InvalidRequestError(spec.name(given[0] if given else "prompt"),
                                  f"give exactly one of {names} (got {what})")
    if spec.prompt_token_ids is not None:
        ids = check_token_ids(spec.name("prompt_token_ids"), spec.prompt_token_ids, card.vocab_size)
    elif spec.messages is not None:
        ids = tokenizer.encode(render(tokenizer, check_messages(spec, limits), spec.tools, spec.tool_format))
    else:
        assert spec.prompt is not None
        ids = tokenizer.encode(spec.prompt)
    if not ids and spec.prompt:  # e.g. control characters SmolLM2's vocabulary has no token for
        raise InvalidRequestError(spec.name(given[0]), "is empty once tokenized: the model's vocabulary "
                                  "spells none of its characters")
    if not ids:
        raise InvalidRequestError(spec.name(given[0]), "is empty")
    limit = min(limits.max_prompt_tokens, card.max_model_len - 1)
    if len(ids) > limit:
        raise InvalidRequestError(spec.name(given[0]), f"{len(ids)} tokens is over the limit of {limit}")
    return ids


def tool_constraint(spec: RequestSpec, tokenizer: Tokenizer) -> None:
    """tool_choice required / named: the output held to the format's grammar of a call."""
    tools = spec.tools
    if tools is None or not tools.enforced or spec.tool_format is None:
        return
    if spec.constraint is not None:
        raise InvalidRequestError(spec.name("tool_choice"), f"{tools.mode.value} cannot be combined with "
                                  f"{spec.name('constraint')}")
    grammar = spec.tool_format.grammar(tools, token_literal(tokenizer.special_id))
    spec.constraint = Constraint(ConstraintKind.GRAMMAR, grammar)
    spec.names = {**spec.names, "constraint": "tools"}


def check_messages(spec: RequestSpec, limits: Limits) -> list[dict[str, Any]]:
    messages = spec.messages or []
    name = spec.name("messages")
    if not messages:
        raise InvalidRequestError(name, "is empty")
    if len(messages) > limits.max_messages:
        raise InvalidRequestError(name, f"{len(messages)} messages is over the limit of {limits.max_messages}")
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or m["role"] not in ROLES:  # a dict is unhashable
            raise InvalidRequestError(f"{name}[{i}].role", f"{m.get('role')!r} is not one of {sorted(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise InvalidRequestError(f"{name}[{i}].content", "must be a string")
    return messages


def default_max_tokens(limits: Limits, room: int, kv_room: int | None) -> int:
    """max_tokens when the request names none: 16, or less where the server's limit, the context
    or the KV cache leaves less room (a request without max_tokens is never refused for it)."""
    return max(1, min(DEFAULT_MAX_TOKENS, limits.max_tokens, room, room if kv_room is None else kv_room))


def _tool_markers(spec: RequestSpec, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """The tool-call marker's id when it is a control token the output must keep (Mistral's)."""
    fmt, tools = spec.tool_format, spec.tools
    if fmt is None or tools is None or not tools.active or fmt.marker is None or tokenizer is None:
        return ()
    marker = tokenizer.special_id(fmt.marker)
    return () if marker is None else (marker,)


def sampling_params(spec: RequestSpec, card: ModelInfo, limits: Limits, prompt_len: int,
                    kv_capacity_tokens: int | None = None, tokenizer: Tokenizer | None = None) -> SamplingParams:
    room = card.max_model_len - prompt_len
    kv_room = None if kv_capacity_tokens is None else kv_capacity_tokens - prompt_len
    max_tokens = default_max_tokens(limits, room, kv_room) if spec.max_tokens is None else spec.max_tokens
    if not 1 <= max_tokens <= limits.max_tokens:
        raise InvalidRequestError(spec.name("max_tokens"),
                                  f"must be in [1, {limits.max_tokens}] (the server's limit), got {max_tokens}")
    if max_tokens > room:
        raise InvalidRequestError(spec.name("max_tokens"), f"{max_tokens} + {prompt_len} prompt tokens is over "
                                  f"the context of {card.max_model_len}; at most {room}")
    top_k = 0 if spec.top_k in (None, -1) else spec.top_k  # -1 = off, as vLLM spells it
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if spec.temperature is None else spec.temperature,
                            top_p=1.0 if spec.top_p is None else spec.top_p, top_k=top_k,
                            seed=spec.seed, ignore_eos=spec.ignore_eos, speculative=spec.speculative,
                            stop_token_ids=tuple(spec.stop_token_ids), stop=tuple(spec.stop),
                            frequency_penalty=spec.frequency_penalty or 0.0,
                            presence_penalty=spec.presence_penalty or 0.0,
                            repetition_penalty=1.0 if spec.repetition_penalty is None else spec.repetition_penalty,
                            logit_bias=tuple(spec.logit_bias.items()), min_tokens=spec.min_tokens or 0,
                            logprobs=spec.logprobs, prompt_logprobs=_prompt_logprobs(spec), n=spec.n,
                            constraint=spec.constraint, keep_special=_tool_markers(spec, tokenizer))
    try:  # the parameters' own rules, the same the engine checks: written once, in core.params
        params.validate(card.vocab_size)
    except InvalidRequestError as e:
        raise InvalidRequestError(spec.name(e.field), e.message + _API_NOTES.get(e.field, "")) from None
    _check_stops(spec, limits)
    if len(spec.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(spec.name("logit_bias"), f"{len(spec.logit_bias)} entries is over the limit of {MAX_LOGIT_BIAS}")
    return params


def _prompt_logprobs(spec: RequestSpec) -> int | None:
    """gRPC asks for prompt logprobs directly; OpenAI completions by `echo` with `logprobs`."""
    if spec.prompt_logprobs is not None:
        return spec.prompt_logprobs
    return spec.logprobs if spec.echo else None


# What the APIs accept beyond SamplingParams' own rules, said where those rules reject a value.
_API_NOTES = {"top_k": " (-1 = off too)"}


def _check_number(spec: RequestSpec, key: str, value: float | None, ok, what: str) -> None:
    if value is not None and not ok(value):  # NaN fails every comparison, so it lands here too
        raise InvalidRequestError(spec.name(key), f"must be {what}, got {value}")


def _check_stops(spec: RequestSpec, limits: Limits) -> None:
    """The server's limits on stop conditions (their values are SamplingParams.validate's)."""
    for key, values in (("stop", spec.stop), ("stop_token_ids", spec.stop_token_ids)):
        if len(values) > limits.max_stop:
            raise InvalidRequestError(spec.name(key), f"{len(values)} entries is over the limit of {limits.max_stop}")
    for s in spec.stop:
        if not s or len(s) > limits.max_stop_chars:
            raise InvalidRequestError(spec.name("stop"), f"stop strings must have 1..{limits.max_stop_chars} "
                                      f"characters, got {len(s)}")


def slo(spec: RequestSpec) -> Slo:
    for key, value in (("ttft_ms", spec.ttft_ms), ("tbt_ms", spec.tbt_ms)):
        _check_number(spec, key, value, lambda v: 0.0 < v < math.inf, "a finite number > 0 (milliseconds)")
    return Slo(spec.ttft_ms, spec.tbt_ms)


def _short(spec: RequestSpec, key: str, value: str | None, limits: Limits) -> str | None:
    if not value:
        return None
    # ASCII: an id travels in logs and trace attributes, and the rule is one a schema can state.
    if len(value) > limits.max_id_chars or not (value.isascii() and value.isprintable()):
        raise InvalidRequestError(spec.name(key), f"must be 1..{limits.max_id_chars} printable ASCII characters")
    return value
