"""OpenAI request bodies -> `RequestSpec`, and results -> OpenAI response/chunk/error JSON.

Strict: a field of the wrong type, an unknown field, or an OpenAI feature Halfmoon does not
implement (n > 1, tools, suffix, ...) is a 400 naming the field — never silently ignored.
Logprobs (chat: `logprobs` + `top_logprobs`; completions: `logprobs: N`, with `echo` the prompt's
too, the first `null`), `frequency_penalty`,
`presence_penalty`, `logit_bias` and `response_format` (json_object, json_schema) as OpenAI defines
them. Extensions, as vLLM spells them: `structured_outputs` (json, json_object, regex, choice,
grammar: api/structured.py),
top_k, ignore_eos, stop_token_ids, seed, repetition_penalty, min_tokens,
speculative (false: opt out of speculative decoding),
cache_salt, priority, request_id, and `slo: {ttft_ms, tbt_ms}`; Halfmoon's own: `priority_class`
(also the `X-Priority-Class` header; the body wins). Answers add `prediction` (what admission
predicted, next to the objectives) to the response and to the stream's finish chunk; a rejection's
error object adds `reason`, `retry_after_s` and, when there is one, `prediction`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

from halfmoon.conductor.errors import RetryableRejection, client_message, field_of, status_of
from halfmoon.api.rejection import prediction_json, rejection_json
from halfmoon.api.requests import RequestSpec
from halfmoon.api.structured import from_openai
from halfmoon.api.tools import ChoiceMode, ToolCall, calls_of, message_keys
from halfmoon.api.tools import from_openai as tools_from_openai
from halfmoon.core.errors import InvalidRequestError
from halfmoon.core.messages import RequestEnd, SloPrediction, Usage

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
           "stream_options", "n", "user", "presence_penalty", "frequency_penalty", "logprobs",
           "ignore_eos", "speculative", "stop_token_ids", "cache_salt", "priority", "priority_class", "request_id", "slo",
           "logit_bias", "repetition_penalty", "min_tokens", "response_format", "structured_outputs"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
SLO_NAMES = {"ttft_ms": "slo.ttft_ms", "tbt_ms": "slo.tbt_ms"}
_TOKEN_KEY = re.compile(r"0|[1-9][0-9]*")  # a logit_bias key: a token id in ASCII decimal, no leading zero
# OpenAI fields accepted only at their neutral value (what "off" means for each).
_NEUTRAL: dict[str, Any] = {"suffix": (None, ""), "best_of": (None, 1)}


def integral(value: Any) -> int | None:
    """A JSON integer as JSON Schema counts them: an int, or a number with no fraction (`16.0`);
    None for anything else (a bool is not a number here)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def integral_list(values: list[Any]) -> list[int] | None:
    ids = [integral(v) for v in values]
    return None if any(i is None for i in ids) else ids  # type: ignore[return-value]


class Body:
    """Typed access to a JSON object's fields; each wrong type is an error naming the field."""

    def __init__(self, data: Any, allowed: set[str]) -> None:
        if not isinstance(data, dict):
            raise InvalidRequestError("body", "must be a JSON object")
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise InvalidRequestError(unknown[0], "unknown field")
        self.data = data

    def get(self, key: str, kinds: tuple[type, ...], what: str) -> Any:
        value = self.data.get(key)
        if value is None:
            return None
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if not ok:
            raise InvalidRequestError(key, f"must be {what}, got {type(value).__name__}")
        return value

    def string(self, key: str) -> str | None:
        return self.get(key, (str,), "a string")

    def integer(self, key: str) -> int | None:
        value = self.data.get(key)
        if value is None:
            return None
        n = integral(value)
        if n is None:
            raise InvalidRequestError(key, f"must be an integer, got {type(value).__name__}")
        return n

    def number(self, key: str) -> float | None:
        value = self.get(key, (int, float), "a number")
        return None if value is None else float(value)

    def boolean(self, key: str) -> bool:
        return bool(self.get(key, (bool,), "a boolean"))

    def int_list(self, key: str) -> list[int] | None:
        value = self.get(key, (list,), "a list of integers")
        if value is None:
            return None
        ids = integral_list(value)
        if ids is None:
            raise InvalidRequestError(key, "must be a list of integers")
        return ids

    def neutral_only(self) -> None:
        for key, neutral in _NEUTRAL.items():
            if key not in self.data:
                continue
            allowed = neutral if isinstance(neutral, tuple) else (neutral,)
            if not any(_same_json(self.data[key], a) for a in allowed):
                raise InvalidRequestError(key, f"is not supported by Halfmoon (only {allowed[0]!r})")


def _same_json(a: Any, b: Any) -> bool:
    """JSON equality: unlike Python's, false is not 0 and true is not 1 (so `echo: 0` is no
    neutral `false`, and `n: true` no `1`)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _stops(body: Body) -> list[str]:
    stop = body.data.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise InvalidRequestError("stop", "must be a string or a list of strings")


def _slo(body: Body) -> tuple[float | None, float | None]:
    slo = body.get("slo", (dict,), "an object {ttft_ms, tbt_ms}") or {}
    unknown = sorted(set(slo) - {"ttft_ms", "tbt_ms"})
    if unknown:
        raise InvalidRequestError(f"slo.{unknown[0]}", "unknown field")
    out = []
    for key in ("ttft_ms", "tbt_ms"):
        v = slo.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise InvalidRequestError(f"slo.{key}", "must be a number (milliseconds)")
        out.append(None if v is None else float(v))
    return out[0], out[1]


def _common(body: Body, spec: RequestSpec) -> tuple[RequestSpec, bool, bool]:
    """Fill the fields both endpoints share; returns (spec, stream, include_usage)."""
    body.neutral_only()
    model = body.string("model")
    if not model:
        raise InvalidRequestError("model", "is required")
    spec.model = model
    spec.temperature, spec.top_p = body.number("temperature"), body.number("top_p")
    spec.top_k, spec.seed = body.integer("top_k"), body.integer("seed")
    spec.stop, spec.stop_token_ids = _stops(body), body.int_list("stop_token_ids") or []
    spec.ignore_eos = body.boolean("ignore_eos")
    spec.speculative = body.get("speculative", (bool,), "a boolean") is not False
    spec.cache_salt, spec.request_id = body.string("cache_salt"), body.string("request_id")
    spec.priority = body.integer("priority") or 0
    spec.priority_class = body.string("priority_class")
    spec.ttft_ms, spec.tbt_ms = _slo(body)
    spec.n = _choices(body)
    _processing(body, spec)
    spec.constraint, source = from_openai(body.data)
    if spec.constraint is not None:
        spec.names = {**spec.names, "constraint": source}
    body.string("user")  # accepted (a string), not used
    stream = body.boolean("stream")
    options = body.get("stream_options", (dict,), "an object") or {}
    if options and not stream:
        raise InvalidRequestError("stream_options", "is only allowed with stream: true")
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise InvalidRequestError("stream_options", f"unknown keys {unknown}")
    return spec, stream, bool(options.get("include_usage"))


def _processing(body: Body, spec: RequestSpec) -> None:
    """Penalties, biases and min_tokens (their ranges are SamplingParams.validate's)."""
    spec.frequency_penalty, spec.presence_penalty = body.number("frequency_penalty"), body.number("presence_penalty")
    spec.repetition_penalty, spec.min_tokens = body.number("repetition_penalty"), body.integer("min_tokens")
    bias = body.get("logit_bias", (dict,), "an object {token id: bias}") or {}
    spec.logit_bias = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and _TOKEN_KEY.fullmatch(key) else None
        if token is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidRequestError("logit_bias", f"must map token ids to numbers, got {key!r}: {value!r}")
        spec.logit_bias[token] = float(value)


def _choices(body: Body) -> int:
    """`n`: 1 when absent; its range is SamplingParams.validate's."""
    n = body.integer("n")
    return 1 if n is None else n


def _chat_logprobs(body: Body) -> int | None:
    """Chat's `logprobs: true` with `top_logprobs: 0..20` -> the top count; None when off."""
    top = body.integer("top_logprobs")
    if not body.boolean("logprobs"):
        if top:
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")
        return None
    return top or 0


def parse_chat(data: Any) -> tuple[RequestSpec, bool, bool]:
    body = Body(data, CHAT_FIELDS)
    spec = RequestSpec(names={"prompt_token_ids": "messages", "prompt": "messages", "logprobs": "top_logprobs",
                              **SLO_NAMES})
    spec.messages = _messages(body)
    spec.logprobs = _chat_logprobs(body)
    mt, mct = body.integer("max_tokens"), body.integer("max_completion_tokens")
    if mt is not None and mct is not None:
        raise InvalidRequestError("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
    spec.max_tokens = mct if mct is not None else mt
    spec.tools = tools_from_openai(body.data)
    out = _common(body, spec)
    if spec.tools is not None and spec.tools.enforced and spec.constraint is not None:
        raise InvalidRequestError("tool_choice", f"{_choice_name(spec.tools.mode)} cannot be combined with "
                                  f"{spec.name('constraint')}")
    return out


def _choice_name(mode: ChoiceMode) -> str:
    return "a named function" if mode is ChoiceMode.NAMED else mode.value


def _messages(body: Body) -> list[dict[str, Any]]:
    messages = body.get("messages", (list,), "a list of messages")
    if messages is None:
        raise InvalidRequestError("messages", "is required")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(m: Any, i: int) -> dict[str, Any]:
    """One turn: {role, content}, an assistant's `tool_calls` (its content may then be null), a
    tool result's `tool_call_id` (and `name`)."""
    if not isinstance(m, dict):
        raise InvalidRequestError(f"messages[{i}]", "must be an object {role, content}")
    role = m.get("role")
    extra = sorted(set(m) - message_keys(role))
    if extra:
        raise InvalidRequestError(f"messages[{i}].{extra[0]}", f"is not supported in a {role!r} message")
    calls = m.get("tool_calls")
    out: dict[str, Any] = {"role": role}
    if calls is not None:
        out["tool_calls"] = calls_of(calls, f"messages[{i}].tool_calls")
    content = m.get("content")
    out["content"] = "" if content is None and role == "assistant" else _content(content, i)
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str):
            raise InvalidRequestError(f"messages[{i}].tool_call_id", "is required (a string)")
        out["tool_call_id"] = call_id
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out


def _content(content: Any, i: int) -> str:
    """A message's text: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"messages[{i}].content", "only text parts {type: text, text} are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(f"messages[{i}].content", "must be a string or a list of text parts")


def parse_completion(data: Any) -> tuple[RequestSpec, bool, bool]:
    body = Body(data, COMPLETION_FIELDS)
    spec = RequestSpec(names={"prompt_token_ids": "prompt", "messages": "prompt", **SLO_NAMES})
    prompt = body.data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        spec.prompt = prompt
    elif isinstance(prompt, list) and prompt and integral_list(prompt) is not None:
        spec.prompt_token_ids = integral_list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise InvalidRequestError("prompt", "batches of prompts are not supported; send one request per prompt")
    elif prompt is None:
        raise InvalidRequestError("prompt", "is required")
    elif isinstance(prompt, list) and not prompt:
        raise InvalidRequestError("prompt", "is empty")
    else:
        raise InvalidRequestError("prompt", "must be a string or a list of token ids")
    spec.max_tokens = body.integer("max_tokens")
    spec.logprobs, spec.echo = body.integer("logprobs"), body.boolean("echo")
    return _common(body, spec)


# ---------------------------------------------------------------------- responses


def usage_json(u: Usage) -> dict[str, Any]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens}}


def choice_json(index: int, text: str, finish: str, chat: bool, logprobs: dict[str, Any] | None,
                calls: Sequence[ToolCall] = ()) -> dict[str, Any]:
    """One choice of a whole answer; `logprobs` in its API's shape (api/logprobs_json.py), None
    when the request did not ask; a chat answer's tool `calls` (its content then null if empty)."""
    if not chat:
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message = {"role": "assistant", "content": text or None, "tool_calls": [c.openai_json() for c in calls]}
    return {"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs}


def finish_with_calls(finish: str, called: bool) -> str:
    """An answer that called tools and ended on its own finishes with `tool_calls`."""
    return "tool_calls" if called and finish == "stop" else finish


def response_json(model: str, rid: str, end: RequestEnd, choices: list[dict[str, Any]], created: int,
                  chat: bool) -> dict[str, Any]:
    """The whole answer of a non-streaming chat (`chat`) or text completion (`choice_json`s)."""
    out = {"id": _id(rid, chat), "object": "chat.completion" if chat else "text_completion",
           "created": created, "model": model, "choices": choices, "usage": usage_json(end.usage)}
    return _with_prediction(out, end.prediction)


def stream_chunk(model: str, rid: str, created: int, chat: bool, content: dict[str, str] | str | None,
                 finish: str | None = None, usage: dict[str, Any] | None = None,
                 prediction: SloPrediction | None = None, logprobs: dict[str, Any] | None = None,
                 index: int = 0) -> dict[str, Any]:
    """One SSE chunk of choice `index`: `content` is the chat delta or the completion text (None:
    no choice, as in the usage chunk), with its tokens' `logprobs`; the request's last finish
    chunk carries the `prediction`."""
    key = "delta" if chat else "text"
    choices = [] if content is None else [{"index": index, key: content, "finish_reason": finish, "logprobs": logprobs}]
    chunk = {"id": _id(rid, chat), "object": "chat.completion.chunk" if chat else "text_completion",
             "created": created, "model": model, "choices": choices}
    if usage is not None:
        chunk["usage"] = usage
    return _with_prediction(chunk, prediction)


def _with_prediction(obj: dict[str, Any], prediction: SloPrediction | None) -> dict[str, Any]:
    """Halfmoon's extension field: what admission predicted for an admitted request."""
    if prediction is not None:
        obj["prediction"] = prediction_json(prediction)
    return obj


def _id(rid: str, chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{rid}"


def error_json(error: BaseException) -> dict[str, Any]:
    """OpenAI's error shape; a rejection also carries its reason, retry hint and prediction."""
    st = status_of(error)
    body: dict[str, Any] = {"message": client_message(error), "type": st.openai_type,
                            "param": field_of(error), "code": st.http}
    if isinstance(error, RetryableRejection):
        body |= rejection_json(error)
    return {"error": body}


def now_s() -> int:
    return int(time.time())
