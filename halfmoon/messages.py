"""The wire side of the SDK, shared by `Client` and `AsyncClient`: request messages built from
keyword arguments, and response messages turned into results."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Any, TypedDict

import grpc

from halfmoon.core.errors import InvalidRequestError
from halfmoon.errors import InternalError, slo_prediction
from halfmoon.results import (AdapterInfo, GenerationResult, ModelInfo, StreamChunk, Timings, TokenLogprobs, ToolCall,
                              Usage)
from halfmoon.v1 import generation_pb2 as pb

_FINISH = MappingProxyType({pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                            pb.FINISH_REASON_ABORT: "abort", pb.FINISH_REASON_TOOL_CALLS: "tool_calls"})


class GenerateOptions(TypedDict, total=False):
    """The keyword arguments of `generate` / `stream` (see `generate_request`)."""

    messages: Sequence[Mapping[str, Any]] | None
    prompt_token_ids: Sequence[int] | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    ttft_slo_ms: float | None
    tbt_slo_ms: float | None
    priority: int
    priority_class: str | None
    cache_salt: str | None
    request_id: str | None
    model: str
    speculative: bool | None
    frequency_penalty: float | None
    presence_penalty: float | None
    repetition_penalty: float | None
    logit_bias: Mapping[int, float] | None
    min_tokens: int | None
    logprobs: int | None
    prompt_logprobs: int | None
    n: int | None
    json_schema: Mapping[str, Any] | str | None
    json_object: bool
    regex: str | None
    choice: Sequence[str] | None
    grammar: str | None
    tools: Sequence[Mapping[str, Any]] | None
    tool_choice: str | Mapping[str, Any] | None
    parallel_tool_calls: bool | None


def generate_request(prompt: str | None = None, *, messages: Sequence[Mapping[str, Any]] | None = None,
                     prompt_token_ids: Sequence[int] | None = None, max_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None,
                     top_k: int | None = None, seed: int | None = None, stop: Sequence[str] = (),
                     stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                     ttft_slo_ms: float | None = None, tbt_slo_ms: float | None = None,
                     priority: int = 0, priority_class: str | None = None, cache_salt: str | None = None,
                     request_id: str | None = None, model: str = "",
                     speculative: bool | None = None, frequency_penalty: float | None = None,
                     presence_penalty: float | None = None, repetition_penalty: float | None = None,
                     logit_bias: Mapping[int, float] | None = None, min_tokens: int | None = None,
                     logprobs: int | None = None, prompt_logprobs: int | None = None,
                     n: int | None = None, json_schema: Mapping[str, Any] | str | None = None,
                     json_object: bool = False, regex: str | None = None, choice: Sequence[str] | None = None,
                     grammar: str | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
                     tool_choice: str | Mapping[str, Any] | None = None,
                     parallel_tool_calls: bool | None = None) -> pb.GenerateRequest:
    """The `GenerateRequest` for these arguments; None = the server's default. Give exactly one
    of `prompt`, `messages` (`{"role", "content"}` dicts) and `prompt_token_ids` (the server
    checks, naming the field). `priority_class`: interactive, standard or batch (the server's
    classes; None = its default class), whose SLOs `ttft_slo_ms` / `tbt_slo_ms` override.
    `speculative=False` opts the request out of the server's speculative decoding. Penalties,
    `logit_bias` and `min_tokens` as the proto documents them; `logprobs=N` (0..20): each token's
    logprob and the N most likely (`StreamChunk.logprobs`, `GenerationResult.logprobs`);
    `prompt_logprobs=N` the same for the prompt's tokens after the first
    (`GenerationResult.prompt_logprobs`); `n=N`: N choices from one prefill
    (`GenerationResult.choices`, `StreamChunk.index`), choice i seeded `seed + i`. At most one
    constraint on the output: `json_schema` (a dict or its JSON text), `json_object=True`,
    `regex`, `choice` (a list of strings) or `grammar` (Lark or GBNF). `tools`: functions the
    model may call, as OpenAI spells them (`{"type": "function", "function": {"name",
    "description", "parameters"}}`) or flat (`{"name", "description", "parameters"}`);
    `tool_choice`: "none", "auto", "required" or a function's name (or OpenAI's
    `{"type": "function", "function": {"name"}}`); the calls come in `GenerationResult.tool_calls`.
    A message may carry an assistant's `tool_calls` (OpenAI's shape) or a tool result's
    `tool_call_id`."""
    sampling = pb.SamplingParams(logit_bias=dict(logit_bias or {}), **_present(
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty, repetition_penalty=repetition_penalty, min_tokens=min_tokens))
    return pb.GenerateRequest(
        model=model, messages=_chat(messages), prompt_token_ids=list(prompt_token_ids or ()),
        sampling=sampling, slo=pb.Slo(**_present(ttft_ms=ttft_slo_ms, tbt_ms=tbt_slo_ms)),
        stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
        priority=priority, priority_class=priority_class or "", cache_salt=cache_salt or "",
        request_id=request_id or "",
        constraint=_constraint(json_schema, json_object, regex, choice, grammar),
        tools=[_tool(t) for t in tools or ()], tool_choice=_tool_choice(tool_choice),
        **_present(prompt=prompt, max_tokens=max_tokens, speculative=speculative, logprobs=logprobs,
                   prompt_logprobs=prompt_logprobs, n=n, parallel_tool_calls=parallel_tool_calls))


def _tool(tool: Mapping[str, Any]) -> pb.Tool:
    fn = tool.get("function", tool) if tool.get("type", "function") == "function" else tool
    parameters = fn.get("parameters")
    return pb.Tool(name=fn.get("name", ""), description=fn.get("description") or "",
                   parameters=parameters if isinstance(parameters, str) else json.dumps(parameters) if parameters else "")


def _tool_choice(choice: str | Mapping[str, Any] | None) -> pb.ToolChoice:
    if choice is None:
        return pb.ToolChoice()
    if isinstance(choice, Mapping):
        return pb.ToolChoice(function=choice.get("function", {}).get("name", ""))
    if choice in ("none", "auto", "required"):
        return pb.ToolChoice(**{choice: True})
    return pb.ToolChoice(function=choice)


def _constraint(json_schema: Mapping[str, Any] | str | None, json_object: bool, regex: str | None,
                choice: Sequence[str] | None, grammar: str | None) -> pb.Constraint:
    given = {k: v for k, v in (("json_schema", json_schema), ("json_object", json_object or None),
                               ("regex", regex), ("choice", choice), ("grammar", grammar)) if v is not None}
    if len(given) > 1:
        raise InvalidRequestError("constraint", f"give at most one of {sorted(given)}")
    if json_schema is not None:
        text = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        return pb.Constraint(json_schema=text)
    if choice is not None:
        return pb.Constraint(choice=pb.ChoiceList(choices=list(choice)))
    return pb.Constraint(**given)


def tokenize_request(text: str | None = None, *, messages: Sequence[Mapping[str, str]] | None = None,
                     model: str = "") -> pb.TokenizeRequest:
    return pb.TokenizeRequest(model=model, messages=_chat(messages), **_present(text=text))


def _present(**fields: Any) -> dict[str, Any]:
    """The fields that were given (proto3 `optional` fields stay unset otherwise)."""
    return {k: v for k, v in fields.items() if v is not None}


def _chat(messages: Sequence[Mapping[str, Any]] | None) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role=m.get("role", ""), content=m.get("content") or "",
                           tool_calls=[_call(c) for c in m.get("tool_calls") or ()],
                           tool_call_id=m.get("tool_call_id") or "") for m in messages or ()]


def _call(call: Any) -> pb.ToolCall:
    """An assistant's call: a `ToolCall` result, or OpenAI's {id, function: {name, arguments}}."""
    if isinstance(call, ToolCall):
        return pb.ToolCall(id=call.id, name=call.name, arguments=call.arguments)
    fn = call.get("function", {})
    arguments = fn.get("arguments", "")
    return pb.ToolCall(id=call.get("id") or "", name=fn.get("name", ""),
                       arguments=arguments if isinstance(arguments, str) else json.dumps(arguments))


class _Choice:
    """One choice's tokens, text and logprobs as they arrive, and how it ended."""

    __slots__ = ("calls", "content", "finish", "logprobs", "stop", "texts", "token_ids", "tokens_used")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.logprobs: list[TokenLogprobs] | None = None
        self.finish: str | None = None
        self.stop: str | None = None
        self.tokens_used = 0
        self.calls: tuple[ToolCall, ...] = ()
        self.content: str | None = None


class Collector:
    """Turns the responses of one Generate call into chunks and, at the end, the result."""

    __slots__ = ("choices", "prompt_logprobs", "received", "request_id", "result")

    def __init__(self) -> None:
        self.request_id = ""
        self.choices: dict[int, _Choice] = {}
        self.prompt_logprobs: list[TokenLogprobs] | None = None
        self.received = 0  # messages delivered to the caller (a stream is retried only at 0)
        self.result: GenerationResult | None = None

    def add(self, response: pb.GenerateResponse) -> StreamChunk:
        self.received += 1
        self.request_id = response.request_id or self.request_id
        choice = self.choices.setdefault(response.index, _Choice())
        ids = list(response.token_ids)
        choice.token_ids.extend(ids)
        choice.texts.append(response.text)
        logprobs = _logprobs(response.logprobs) or None
        if logprobs is not None:
            choice.logprobs = [*(choice.logprobs or []), *logprobs]
        if response.prompt_logprobs:
            self.prompt_logprobs = _logprobs(response.prompt_logprobs)
        if response.HasField("choice_end"):
            end = response.choice_end
            choice.finish, choice.stop, choice.tokens_used = _finish(end.finish_reason), end.stop or None, \
                end.completion_tokens
            choice.calls, choice.content = _calls(end.tool_calls), end.content if end.tool_calls else None
        if response.HasField("final"):
            self.result = self._result(response.final)
        return StreamChunk(self.request_id, ids, response.text, self.result, logprobs, response.index)

    def finish(self) -> GenerationResult:
        """The result; raises InternalError when the stream ended without its final message."""
        if self.result is None:
            raise InternalError(grpc.StatusCode.INTERNAL, "the stream ended without its final message")
        return self.result

    def _result(self, final: pb.Final) -> GenerationResult:
        u, t = final.usage, final.timings
        usage = Usage(u.prompt_tokens, u.cached_prompt_tokens, u.completion_tokens)
        timings = Timings(t.queue_ms, t.prefill_ms, t.transfer_ms, t.ttft_ms, t.mean_tpot_ms, t.e2e_ms)
        prediction = slo_prediction(final.prediction) if final.HasField("prediction") else None
        reason, stop = _finish(final.finish_reason), final.stop or None
        first = self.choices.setdefault(0, _Choice())
        if first.finish is None and final.tool_calls:
            first.calls, first.content = _calls(final.tool_calls), final.content
        result = GenerationResult(self.request_id, "".join(first.texts), list(first.token_ids),
                                  first.finish or reason, first.stop if first.finish else stop, usage, timings,
                                  prediction, first.logprobs, self.prompt_logprobs, tool_calls=first.calls,
                                  content=first.content)
        if len(self.choices) == 1 and first.finish is None:
            return result
        choices = tuple(GenerationResult(self.request_id, "".join(c.texts), list(c.token_ids), c.finish or reason,
                                         c.stop, replace(usage, completion_tokens=c.tokens_used), timings, prediction,
                                         c.logprobs, self.prompt_logprobs if i == 0 else None,
                                         tool_calls=c.calls, content=c.content)
                        for i, c in sorted(self.choices.items()))
        return replace(result, choices=choices)


def _calls(values: Sequence[pb.ToolCall]) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(c.id, c.name, c.arguments) for c in values)


def _logprobs(values: Sequence[pb.TokenLogprob]) -> list[TokenLogprobs]:
    return [TokenLogprobs(lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top)) for lp in values]


def _finish(reason: int) -> str:
    if reason not in _FINISH:
        raise InternalError(grpc.StatusCode.INTERNAL, f"unknown finish reason {reason}")
    return _FINISH[reason]


def model_info(m: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(m.id, m.max_model_len, m.vocab_size, m.owned_by, m.architecture, m.dtype, m.parent)


def adapter_info(a: pb.AdapterInfo) -> AdapterInfo:
    return AdapterInfo(a.name, a.path, a.digest, a.rank, tuple(a.target_modules), a.base_model, a.load_ms,
                       a.loaded_at)
