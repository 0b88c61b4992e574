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

from halfmoon.api.requests import MAX_LOGIT_BIAS, Limits
from halfmoon.api.tools import MAX_TOOLS, TOOL_NAME
from halfmoon.conductor.adapters import NAME
from halfmoon.core.params import BIAS_LIMIT, MAX_CHOICES, MAX_LOGPROBS, PENALTY_LIMIT
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


def model_field(base_id: str) -> Schema:
    """A request's `model`: the base model, or any name (LoRA adapters come and go while the
    server runs). The base model's id is its own branch, so generated requests name it often."""
    return {"anyOf": [{"const": base_id}, {"type": "string", "minLength": 1}],
            "description": "the served model, or a loaded LoRA adapter's name (GET /v1/models); any other name "
                           "is a 404"}


def _common(limits: Limits, model: ModelInfo, classes: frozenset[str], kv: int | None) -> dict[str, Schema]:
    stop = {"type": "string", "minLength": 1, "maxLength": limits.max_stop_chars}
    short_id = {"type": "string", "maxLength": limits.max_id_chars, "pattern": ID_PATTERN}
    return {
        "model": model_field(model.id),
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
        "n": nullable({"type": "integer", "minimum": 1, "maximum": MAX_CHOICES, "description":
                       "choices from one prefill; choice i of a seeded request is seeded seed + i"}),
        "presence_penalty": nullable({"type": "number", "minimum": -PENALTY_LIMIT, "maximum": PENALTY_LIMIT,
                                      "description": "OpenAI's: minus this for every output token seen once"}),
        "frequency_penalty": nullable({"type": "number", "minimum": -PENALTY_LIMIT, "maximum": PENALTY_LIMIT,
                                       "description": "OpenAI's: minus this times each output token's count"}),
        "repetition_penalty": nullable({"type": "number", "exclusiveMinimum": 0, "description":
                                        "HF's, over prompt + output; 1 = off"}),
        "logit_bias": nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                                "propertyNames": {"pattern": "^" + range_regex(model.vocab_size - 1) + "$"},
                                "additionalProperties": {"type": "number", "minimum": -BIAS_LIMIT,
                                                         "maximum": BIAS_LIMIT},
                                "description": "token id -> bias added to its logit"}),
        "min_tokens": nullable({"type": "integer", "minimum": 0, "description": "EOS and stop_token_ids cannot end the first min(min_tokens, "
                                               "max_tokens) outputs"}),
        "response_format": nullable(RESPONSE_FORMAT),
        "structured_outputs": nullable(STRUCTURED_OUTPUTS),
    }


# Structured outputs (api/structured.py). What the grammar engine accepts is no JSON Schema: a
# schema's keywords, a regex's and a grammar's syntax are checked when it compiles (400 naming
# what it cannot enforce). The documented shapes are the part a fuzzer can generate valid.
_JSON_SCHEMA_VALUE: Schema = {"type": "object", "description":
                              "a JSON Schema; a keyword the grammar engine does not implement (uniqueItems, "
                              "not, if/then/else, ...) or an unsatisfiable schema is a 400 naming it"}
_REGEX: Schema = {"type": "string", "minLength": 1, "format": "regex", "description":
                  "Rust regex syntax; the whole output matches it (anchors optional); invalid: 400"}
_GRAMMAR: Schema = {"type": "string", "pattern": '^start: "[a-z]{1,8}"$', "description":
                    "a Lark grammar (llguidance's dialect) or GBNF; the pattern is the sliver a fuzzer "
                    "can generate, any grammar that compiles is served (400 naming the error otherwise)"}
RESPONSE_FORMAT: Schema = {"oneOf": [
    {"type": "object", "additionalProperties": False, "required": ["type"],
     "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "additionalProperties": False, "required": ["type", "json_schema"],
     "properties": {"type": {"const": "json_schema"}, "json_schema": {
         "type": "object", "additionalProperties": False, "required": ["name"],
         "properties": {"name": {"type": "string", "minLength": 1}, "schema": nullable(_JSON_SCHEMA_VALUE),
                        "strict": nullable({"type": "boolean", "description": "enforced either way"}),
                        "description": nullable({"type": "string"})}}}}],
    "description": "OpenAI's: text, any JSON object, or a JSON Schema the output is held to"}
_ONE_CONSTRAINT: Schema = {"not": {
    "required": ["response_format", "structured_outputs"],
    "properties": {"response_format": {"type": "object", "required": ["type"],
                                       "properties": {"type": {"enum": ["json_object", "json_schema"]}}},
                   "structured_outputs": {"type": "object"}}}}
STRUCTURED_OUTPUTS: Schema = {"oneOf": [
    {"type": "object", "additionalProperties": False, "required": [key], "properties": {key: value}}
    for key, value in (("json", _JSON_SCHEMA_VALUE), ("json_object", {"const": True}), ("regex", _REGEX),
                       ("choice", {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}),
                       ("grammar", _GRAMMAR))],
    "description": "vLLM's spelling, exactly one of json, json_object, regex, choice, grammar; not with "
                   "response_format"}


def range_regex(n: int) -> str:
    """A regex of the decimal integers 0..n, no leading zeros (a JSON object key is a string)."""
    digits = str(n)
    if len(digits) == 1:
        return f"([0-{n}])"
    shorter = ["[0-9]"] + [f"[1-9][0-9]{{{k}}}" for k in range(1, len(digits) - 1)]
    same = []
    for i, d in enumerate(digits):
        low = "1" if i == 0 else "0"
        if int(d) > int(low):
            rest = len(digits) - i - 1
            same.append(digits[:i] + f"[{low}-{int(d) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    same.append(digits)
    return "(" + "|".join(shorter + same) + ")"


# stream_options with keys is allowed only when streaming.
_STREAM_OPTIONS_NEED_STREAM: Schema = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object", "minProperties": 1}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}


# top_logprobs > 0 only with logprobs: true.
_TOP_NEEDS_LOGPROBS: Schema = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
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
        "echo": nullable({"type": "boolean", "description": "the answer starts with the prompt (with logprobs: its "
                                                            "tokens' too, the first null)"}),
        "suffix": _neutral(None, ""), "best_of": _neutral(None, 1),
        "logprobs": nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS, "description":
                              "each token's logprob and the N most likely (raw log_softmax)"})}
    return {"type": "object", "required": ["model", "prompt"], "additionalProperties": False,
            "properties": properties, "allOf": [_STREAM_OPTIONS_NEED_STREAM, _ONE_CONSTRAINT]}


_PART: Schema = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_CONTENT: Schema = {"anyOf": [{"type": "string"}, {"type": "array", "items": _PART}]}
_CALL: Schema = {"type": "object", "required": ["function"], "additionalProperties": False, "properties": {
    "id": nullable({"type": "string"}), "type": nullable({"const": "function"}),
    "function": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
        "name": {"type": "string"},
        "arguments": nullable({"anyOf": [{"type": "string"}, {"type": "object"}], "description":
                               "JSON text of an object (OpenAI's), or the object"})}}}}


def _turn(role: str, required: list[str], **fields: Schema) -> Schema:
    return {"type": "object", "required": ["role", *required], "additionalProperties": False,
            "properties": {"role": {"const": role}, "name": {"description": "accepted, not used"}, **fields}}


MESSAGE: Schema = {"oneOf": [
    *(_turn(role, ["content"], content=_CONTENT) for role in ("system", "user")),
    _turn("assistant", [], content=nullable(_CONTENT), refusal={"description": "accepted, not used"},
          tool_calls=nullable({"type": "array", "minItems": 1, "items": _CALL,
                               "description": "calls it made, fed back through the chat template"})),
    _turn("tool", ["content", "tool_call_id"], content=_CONTENT, tool_call_id={"type": "string"})]}
TOOL: Schema = {"type": "object", "required": ["type", "function"], "additionalProperties": False, "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
        "name": {"type": "string", "pattern": "^" + TOOL_NAME.pattern + "$"},
        "description": nullable({"type": "string"}),
        "parameters": nullable({**_JSON_SCHEMA_VALUE, "description": "its arguments' JSON Schema (default: no "
                                "arguments); with tool_choice required or named, a keyword the grammar engine "
                                "does not implement is a 400 naming it"}),
        "strict": nullable({"type": "boolean", "description": "enforced either way with required / named"})}}}}
TOOL_CHOICE: Schema = {"anyOf": [
    {"enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["type", "function"], "additionalProperties": False, "properties": {
        "type": {"const": "function"}, "function": {
            "type": "object", "required": ["name"], "additionalProperties": False,
            "properties": {"name": {"type": "string", "description": "one of the tools' names (400 otherwise)"}}}}}],
    "description": "none: no tools offered; auto (the default with tools; without, the same as none): the "
                   "answer is read for calls; "
                   "required (one or more calls, at most 8) and a named function (one call) are held to a grammar"}
_ENFORCED: Schema = {"anyOf": [{"const": "required"}, {"type": "object"}]}
# tool_choice required / named needs tools and no other constraint (one rule: the fuzzer's
# generator expands each if/then into alternatives, and a few more are too many for it).
_TOOL_RULES: list[Schema] = [
    {"if": {"required": ["tool_choice"], "properties": {"tool_choice": _ENFORCED}},
     "then": {"required": ["tools"], "properties": {
         "tools": {"type": "array", "minItems": 1}, "structured_outputs": {"type": "null"},
         "response_format": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"type": {"const": "text"}}}]}}}},
]


def chat_request(limits: Limits, model: ModelInfo, classes: frozenset[str], kv: int | None) -> Schema:
    common = _common(limits, model, classes, kv)
    properties = common | {
        "messages": {"type": "array", "items": MESSAGE, "minItems": 1, "maxItems": limits.max_messages,
                     "description": f"at most {limits.max_prompt_tokens} tokens once templated, with the tools "
                                    "(400 otherwise)"},
        "max_completion_tokens": common["max_tokens"],
        "logprobs": nullable({"type": "boolean", "description": "each token's logprob (raw log_softmax)"}),
        "top_logprobs": nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                                  "description": "the N most likely tokens per position; > 0 needs logprobs: true"}),
        "tools": nullable({"type": "array", "items": TOOL, "maxItems": MAX_TOOLS,
                           "description": "functions the model may call (a repeated name: the first)"}),
        "tool_choice": nullable(TOOL_CHOICE),
        "parallel_tool_calls": nullable({"type": "boolean", "description": "false: at most one call"})}
    both = {"required": ["max_tokens", "max_completion_tokens"], "properties": {
        "max_tokens": {"type": "integer"}, "max_completion_tokens": {"type": "integer"}}}
    return {"type": "object", "required": ["model", "messages"], "additionalProperties": False,
            "properties": properties, "not": both,
            "allOf": [_STREAM_OPTIONS_NEED_STREAM, _TOP_NEEDS_LOGPROBS, _ONE_CONSTRAINT, *_TOOL_RULES]}


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
_FINISH = {"enum": ["stop", "length", "abort", "tool_calls"]}


def _answer(kind: str, choice: dict[str, Schema], logprobs: Schema) -> Schema:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
        "id": {"type": "string"}, "object": {"const": kind}, "created": {"type": "integer"},
        "model": {"type": "string"}, "usage": ref("Usage"), "prediction": ref("Prediction"),
        "choices": {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "description": "n of them, in index order",
                    "items": {
            "type": "object", "required": ["index", "finish_reason", *choice],
            "properties": {"index": {"type": "integer", "minimum": 0, "maximum": MAX_CHOICES - 1}, "finish_reason": _FINISH, "logprobs": nullable(logprobs),
                           **choice}}}}}


_TOKEN_LOGPROB: Schema = {"type": "object", "required": ["token", "logprob", "bytes"], "properties": {
    "token": {"type": "string"}, "logprob": {"type": "number"},
    "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}}}}
CHAT_LOGPROBS: Schema = {"type": "object", "required": ["content"], "properties": {"content": {
    "type": "array", "items": {**_TOKEN_LOGPROB, "required": [*_TOKEN_LOGPROB["required"], "top_logprobs"],
                              "properties": {**_TOKEN_LOGPROB["properties"],
                                             "top_logprobs": {"type": "array", "items": _TOKEN_LOGPROB}}}}}}
COMPLETION_LOGPROBS: Schema = {"type": "object", "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
                               "properties": {"tokens": {"type": "array", "items": {"type": "string"}},
                                              "token_logprobs": {"type": "array", "items": nullable({"type": "number"})},
                                              "top_logprobs": {"type": "array", "items": nullable({
                                                  "type": "object", "additionalProperties": {"type": "number"}})},
                                              "text_offset": {"type": "array", "items": {"type": "integer"}}}}
COMPLETION = _answer("text_completion", {"text": {"type": "string"}}, COMPLETION_LOGPROBS)
_ANSWERED_CALL: Schema = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"}, "function": {
        "type": "object", "required": ["name", "arguments"],
        "properties": {"name": {"type": "string"}, "arguments": {"type": "string", "description": "JSON text"}}}}}
CHAT_COMPLETION = _answer("chat.completion", {"message": {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"const": "assistant"}, "content": nullable({"type": "string"}),
                   "tool_calls": {"type": "array", "items": _ANSWERED_CALL}}}}, CHAT_LOGPROBS)
MODEL_LIST: Schema = {"type": "object", "required": ["object", "data"], "properties": {
    "object": {"const": "list"}, "data": {"type": "array", "description": "the base model, then each LoRA adapter",
                                          "items": {
        "type": "object", "required": ["id", "object", "created", "owned_by", "max_model_len", "root", "parent"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
            "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"},
            "architecture": {"type": "string"}, "dtype": {"type": "string"},
            "root": {"type": "string", "description": "the base model's id; an adapter's folder"},
            "parent": nullable({"type": "string", "description": "an adapter's base model; null for the base"})}}}}}

# ---------------------------------------------------------------------- the admin API (api/admin.py)


def load_adapter_request(base_id: str) -> Schema:
    """`POST /v1/load_lora_adapter`'s body (vLLM's): a name requests will use, a PEFT folder."""
    return {"type": "object", "required": ["lora_name", "lora_path"], "additionalProperties": False, "properties": {
        "lora_name": {"type": "string", "pattern": NAME.pattern, "not": {"const": base_id}, "description":
                      "the `model` requests name it by; the same name and files again: a no-op; other files "
                      "under a loaded name: 409 (unload it first)"},
        "lora_path": {"type": "string", "minLength": 1, "description":
                      "a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) the Conductor and "
                      "every worker can read; one this base model cannot serve (missing files, shapes, rank over "
                      "--max-lora-rank, target modules, another base model) is a 400 naming the reason"},
        "load_inplace": _neutral(None, False)}}


UNLOAD_ADAPTER_REQUEST: Schema = {"type": "object", "required": ["lora_name"], "additionalProperties": False,
                                  "properties": {"lora_name": {"type": "string", "minLength": 1,
                                                               "description": "a loaded adapter (404 otherwise)"},
                                                 "lora_int_id": {"description": "vLLM's; accepted, not used"}}}
ADAPTER: Schema = {"type": "object", "required": ["name", "path", "digest", "rank", "target_modules", "base_model",
                                                  "load_ms", "loaded_at"], "properties": {
    "name": {"type": "string"}, "path": {"type": "string"},
    "digest": {"type": "string", "description": "of its two files: new weights under one name are a new digest"},
    "rank": {"type": "integer", "minimum": 1}, "target_modules": {"type": "array", "items": {"type": "string"}},
    "base_model": {"type": "string", "description": "its base_model_name_or_path (empty: not said)"},
    "load_ms": {"type": "number", "minimum": 0, "description": "reading and checking it at the Conductor"},
    "loaded_at": {"type": "integer", "description": "Unix seconds"}}}
ADAPTER_LIST: Schema = {"type": "object", "required": ["object", "data"], "properties": {
    "object": {"const": "list"}, "data": {"type": "array", "items": ref("LoraAdapter")}}}
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
