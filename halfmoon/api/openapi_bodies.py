"""JSON Schemas (OpenAPI 3.1) of the HTTP API's bodies, written from the parsers they describe.

Each request schema states exactly what `api/openai_schema.py` and `api/requests.py`
accept, with this server's limits and model filled in (a schema is built per running server), so
a fuzzer can hold the server to it both ways: data the schema allows is served, data it forbids
is a 4xx. Two rules are not expressible in a schema and are said in the descriptions instead:
a text prompt's length in tokens (the tokenizer decides), and prompt + max_tokens fitting the
model's context and the KV cache.
"""

from __future__ import annotations

from typing import Any

from halfmoon.api.requests import ROLES, Limits
from halfmoon.engine.tokenizer import Tokenizer
from halfmoon.results import ModelInfo

Schema = dict[str, Any]
ID_PATTERN = r"^[\x20-\x7e]*$"  # what `requests._short` accepts: printable ASCII


def nullable(schema: Schema) -> Schema:
    """`schema` or JSON null (every optional field of the OpenAI parsers treats null as absent)."""
    return {"anyOf": [schema, {"type": "null"}]}


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _token_ids(vocab_size: int, max_items: int) -> Schema:
    return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
            "maxItems": max_items}


def _neutral(*values: Any) -> Schema:
    """An OpenAI feature Halfmoon does not implement: only its "off" value is accepted."""
    return {"enum": list(values), "description": "not implemented by Halfmoon: only the neutral value"}


def max_tokens_bound(limits: Limits, model: ModelInfo, kv_capacity_tokens: int | None) -> int:
    """The largest max_tokens any request can be served with (a prompt has at least one token)."""
    bounds = [limits.max_tokens, model.max_model_len - 1]
    if kv_capacity_tokens is not None:
        bounds.append(kv_capacity_tokens - 1)
    return max(1, min(bounds))


def prompt_bound(limits: Limits, model: ModelInfo, kv_capacity_tokens: int | None) -> int:
    """The longest prompt (tokens) the server takes with the default max_tokens."""
    bounds = [limits.max_prompt_tokens, model.max_model_len - 1]
    if kv_capacity_tokens is not None:
        bounds.append(kv_capacity_tokens - 1)
    return max(1, min(bounds))


def _common(limits: Limits, model: ModelInfo, classes: frozenset[str], kv: int | None) -> dict[str, Schema]:
    stop = {"type": "string", "minLength": 1, "maxLength": limits.max_stop_chars}
    short_id = {"type": "string", "maxLength": limits.max_id_chars, "pattern": ID_PATTERN}
    return {
        "model": {"type": "string", "enum": [model.id], "description": "the served model (GET /v1/models)"},
        "max_tokens": nullable({"type": "integer", "minimum": 1, "maximum": max_tokens_bound(limits, model, kv),
                                "description": "default min(16, the room left); prompt + max_tokens must fit "
                                               "the context and a decode worker's KV cache (400 otherwise)"}),
        "temperature": nullable({"type": "number", "minimum": 0, "description": "0 = greedy (the default)"}),
        "top_p": nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": nullable({"type": "integer", "minimum": -1, "description": "-1 or 0 = off"}),
        "seed": nullable({"type": "integer", "minimum": 0, "maximum": 2**63 - 1}),
        "stop": nullable({"anyOf": [stop, {"type": "array", "items": stop, "maxItems": limits.max_stop}]}),
        "stop_token_ids": nullable(_token_ids(model.vocab_size, limits.max_stop)),
        "stream": nullable({"type": "boolean", "description": "true: Server-Sent Events"}),
        "stream_options": nullable({"type": "object", "additionalProperties": False, "description":
                                    "only with stream: true (unless empty)", "properties": {
                                        "include_usage": {}, "continuous_usage_stats": {}}}),
        "ignore_eos": nullable({"type": "boolean"}),
        "speculative": nullable({"type": "boolean", "description": "false: opt out of speculative decoding"}),
        "user": nullable({"type": "string", "description": "accepted, not used"}),
        "cache_salt": nullable(short_id), "request_id": nullable(short_id),
        "priority": nullable({"type": "integer", "description": "lower is served first"}),
        "priority_class": nullable({"type": "string", "enum": ["", *sorted(classes)], "description":
                                    "also the X-Priority-Class header (the body wins); empty = the default"}),
        "slo": nullable({"type": "object", "additionalProperties": False, "properties": {
            "ttft_ms": nullable({"type": "number", "exclusiveMinimum": 0}),
            "tbt_ms": nullable({"type": "number", "exclusiveMinimum": 0})},
            "description": "objectives; a request predicted to miss one is a 429 before any work"}),
        "n": _neutral(1), "presence_penalty": _neutral(0), "frequency_penalty": _neutral(0),
        "logprobs": _neutral(None, False),
    }


# stream_options with keys is allowed only when streaming.
_STREAM_OPTIONS_NEED_STREAM: Schema = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object", "minProperties": 1}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}


def unspellable(tokenizer: Tokenizer) -> str:
    """The ASCII characters `tokenizer` turns into no token at all (SmolLM2's vocabulary has none
    for six control characters, which it drops): a text of only these is an empty prompt."""
    return "".join(chr(b) for b in range(128) if not tokenizer.encode(chr(b)))


def _text_prompt(limits: Limits, dropped: str) -> Schema:
    text: Schema = {"type": "string", "minLength": 1,
                    "description": f"at most {limits.max_prompt_tokens} tokens once tokenized (400 otherwise)"}
    if dropped:  # at least one character the vocabulary can spell
        text["pattern"] = "[^" + "".join(f"\\x{ord(c):02x}" for c in dropped) + "]"
    return text


def completion_request(limits: Limits, model: ModelInfo, classes: frozenset[str], kv: int | None,
                       dropped: str = "") -> Schema:
    """`dropped`: the characters the tokenizer spells as no token (`unspellable`)."""
    ids = {**_token_ids(model.vocab_size, prompt_bound(limits, model, kv)), "minItems": 1}
    text = _text_prompt(limits, dropped)
    batch_of_one = {"type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": [text, ids]}}
    properties = _common(limits, model, classes, kv) | {
        "prompt": {"anyOf": [text, ids, batch_of_one], "description": "text, token ids, or a batch of one"},
        "echo": _neutral(False), "suffix": _neutral(None, ""), "best_of": _neutral(None, 1)}
    return {"type": "object", "required": ["model", "prompt"], "additionalProperties": False,
            "properties": properties, **_STREAM_OPTIONS_NEED_STREAM}


def chat_request(limits: Limits, model: ModelInfo, classes: frozenset[str], kv: int | None) -> Schema:
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role", "content"], "additionalProperties": False, "properties": {
        "role": {"enum": sorted(ROLES)},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]},
        "name": {"description": "accepted, not used"}}}
    common = _common(limits, model, classes, kv)
    properties = common | {
        "messages": {"type": "array", "items": message, "minItems": 1, "maxItems": limits.max_messages,
                     "description": f"at most {limits.max_prompt_tokens} tokens once templated (400 otherwise)"},
        "max_completion_tokens": common["max_tokens"],
        "top_logprobs": _neutral(None, 0), "tools": _neutral(None, []), "tool_choice": _neutral(None, "none"),
        "response_format": _neutral(None, {"type": "text"})}
    both = {"required": ["max_tokens", "max_completion_tokens"], "properties": {
        "max_tokens": {"type": "integer"}, "max_completion_tokens": {"type": "integer"}}}
    return {"type": "object", "required": ["model", "messages"], "additionalProperties": False,
            "properties": properties, "not": both, **_STREAM_OPTIONS_NEED_STREAM}


# ---------------------------------------------------------------------- responses

_NUMBER_OR_NULL = nullable({"type": "number"})
PREDICTION: Schema = {"type": "object", "required": ["predicted_ttft_ms", "predicted_tbt_ms", "ttft_slo_ms",
                                                      "tbt_slo_ms"],
                      "properties": {k: _NUMBER_OR_NULL for k in ("predicted_ttft_ms", "predicted_tbt_ms",
                                                                  "ttft_slo_ms", "tbt_slo_ms")},
                      "description": "what admission predicted, next to the objectives (ms; 0 = none)"}
USAGE: Schema = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
                 "properties": {"prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
                                "total_tokens": {"type": "integer"}, "prompt_tokens_details": {
                                    "type": "object", "properties": {"cached_tokens": {"type": "integer"}}}}}
_FINISH = {"enum": ["stop", "length", "abort"]}


def _answer(kind: str, choice: dict[str, Schema]) -> Schema:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
        "id": {"type": "string"}, "object": {"const": kind}, "created": {"type": "integer"},
        "model": {"type": "string"}, "usage": ref("Usage"), "prediction": ref("Prediction"),
        "choices": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
            "type": "object", "required": ["index", "finish_reason", *choice],
            "properties": {"index": {"const": 0}, "finish_reason": _FINISH, "logprobs": {"type": "null"},
                           **choice}}}}}


COMPLETION = _answer("text_completion", {"text": {"type": "string"}})
CHAT_COMPLETION = _answer("chat.completion", {"message": {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}})
MODEL_LIST: Schema = {"type": "object", "required": ["object", "data"], "properties": {
    "object": {"const": "list"}, "data": {"type": "array", "items": {
        "type": "object", "required": ["id", "object", "created", "owned_by", "max_model_len"], "properties": {
            "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
            "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"},
            "architecture": {"type": "string"}, "dtype": {"type": "string"}}}}}}
HEALTH: Schema = {"type": "object", "required": ["status"], "properties": {
    "status": {"enum": ["ok", "degraded", "unavailable"]},
    "reasons": {"type": "array", "items": {"type": "string"}, "description": "why degraded"}}}
ERROR: Schema = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string", "description": "OpenAI's error type"},
        "param": nullable({"type": "string", "description": "the request field the error is about"}),
        "code": {"type": "integer", "description": "the HTTP status"}}}}}
REJECTION: Schema = {"type": "object", "required": ["error"], "properties": {"error": {
    "allOf": [ERROR["properties"]["error"], {"type": "object", "required": ["reason", "retry_after_s"],
                                             "properties": {"reason": {"type": "string"},
                                                            "retry_after_s": {"type": "number", "minimum": 0},
                                                            "prediction": ref("Prediction")}}]}}}
