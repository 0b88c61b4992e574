"""Tool calling as clients ask for it: OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`,
and the conversation's tool turns (assistant `tool_calls`, `tool` results).

    tools:        [{"type": "function", "function": {"name", "description", "parameters",
                                                       "strict"}}]          (at most 128)
    tool_choice:  "none" | "auto" (the default with tools) | "required"
                  | {"type": "function", "function": {"name": ...}}         (named)
    parallel_tool_calls: true (the default: one or more calls) | false (at most one)

`none` and `auto` leave the model free (auto: its output is parsed for calls in its family's
format, api/tool_formats.py); `required` and a named function are enforced by a grammar, so
every answer that ends with `stop` is a call to an allowed function whose arguments validate
against its `parameters`.
"""

from __future__ import annotations

import enum
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from halfmoon.core.errors import InvalidRequestError

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")  # OpenAI's function names (a-z, 0-9, _ and -, <= 64)
_TOOL_KEYS = {"type", "function"}
_CALL_KEYS = {"id", "type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
EMPTY_PARAMETERS: Mapping[str, Any] = {"type": "object", "properties": {}}


class ChoiceMode(str, enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True, slots=True)
class Tool:
    """One function the model may call; `parameters` is its arguments' JSON Schema (text, in
    the client's key order: the grammar writes arguments in that order)."""

    name: str
    description: str = ""
    parameters: str = json.dumps(EMPTY_PARAMETERS)

    @property
    def schema(self) -> dict[str, Any]:
        return json.loads(self.parameters)

    def openai_json(self) -> dict[str, Any]:
        """The tool as chat templates take it (HF's convention: OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.schema
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """What a request offers and demands: its tools, how the model must use them, and whether
    one answer may call several."""

    tools: tuple[Tool, ...]
    mode: ChoiceMode = ChoiceMode.AUTO
    named: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """The model is told about the tools and its output parsed for calls."""
        return self.mode is not ChoiceMode.NONE

    @property
    def enforced(self) -> bool:
        """A call is guaranteed: the output is held to the format's grammar."""
        return self.mode in (ChoiceMode.REQUIRED, ChoiceMode.NAMED)

    @property
    def many(self) -> bool:
        """An enforced answer may hold several calls: tool_choice required with parallel calls
        (a named function is called once, as OpenAI's named choice does)."""
        return self.parallel and self.mode is ChoiceMode.REQUIRED

    @property
    def allowed(self) -> tuple[Tool, ...]:
        """The functions an answer may call (a named choice: that one)."""
        if self.mode is ChoiceMode.NAMED:
            return tuple(t for t in self.tools if t.name == self.named)
        return self.tools

    def find(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made: `arguments` is JSON text (an object), as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def openai_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    """A fresh call id: `call_` + 24 hex digits (Mistral's 9-alphanumeric ids are the format's)."""
    return "call_" + secrets.token_hex(12)


def from_openai(body: Mapping[str, Any]) -> ToolRequest | None:
    """The body's tools and tool choice (None: no tools, and `tool_choice` absent or none)."""
    tools = _tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls", "must be a boolean")
    mode, named = _choice(body.get("tool_choice"), bool(tools))
    if not tools:
        return None
    if mode is ChoiceMode.NAMED and not any(t.name == named for t in tools):
        raise InvalidRequestError("tool_choice.function.name", f"{named!r} is not one of the tools "
                                  f"{[t.name for t in tools]}")
    return ToolRequest(tuple(tools), mode, named, parallel is not False)


def from_proto(tools: Sequence[Any], choice: Any, parallel: bool | None) -> ToolRequest | None:
    """gRPC's `tools`, `tool_choice` (a ToolChoice, unset: none given) and `parallel_tool_calls`."""
    listed = [{"type": "function", "function": {"name": t.name, "description": t.description or None,
                                                 "parameters": _schema(t.parameters, f"tools[{i}].parameters")}}
              for i, t in enumerate(tools)]
    kind = choice.WhichOneof("kind")
    named = {"type": "function", "function": {"name": choice.function}} if kind == "function" else None
    return from_openai({"tools": listed or None, "tool_choice": named or kind, "parallel_tool_calls": parallel})


def _schema(text: str, field: str) -> Any:
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        raise InvalidRequestError(field, "is not valid JSON") from None


def _tools(value: Any) -> list[Tool]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequestError("tools", "must be a list of {type: function, function}")
    if len(value) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"{len(value)} tools is over the limit of {MAX_TOOLS}")
    return [_tool(item, f"tools[{i}]") for i, item in enumerate(value)]  # a repeated name: the first


def _tool(item: Any, field: str) -> Tool:
    if not isinstance(item, dict):
        raise InvalidRequestError(field, "must be an object {type: function, function}")
    extra = sorted(set(item) - _TOOL_KEYS)
    if extra:
        raise InvalidRequestError(f"{field}.{extra[0]}", "unknown field")
    if item.get("type") != "function":
        raise InvalidRequestError(f"{field}.type", "must be function")
    fn = item.get("function")
    if not isinstance(fn, dict):
        raise InvalidRequestError(f"{field}.function", "must be an object {name, description, parameters}")
    extra = sorted(set(fn) - _FUNCTION_KEYS)
    if extra:
        raise InvalidRequestError(f"{field}.function.{extra[0]}", "unknown field")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise InvalidRequestError(f"{field}.function.name", "must be 1..64 letters, digits, _ . or -, "
                                  "not starting with a digit")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"{field}.function.description", "must be a string")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise InvalidRequestError(f"{field}.function.strict", "must be a boolean")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"{field}.function.parameters", "must be a JSON Schema (an object)")
    return Tool(name, description or "", json.dumps(parameters))


def _choice(value: Any, has_tools: bool) -> tuple[ChoiceMode, str | None]:
    if value is None:
        return (ChoiceMode.AUTO if has_tools else ChoiceMode.NONE), None
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise InvalidRequestError("tool_choice", f"must be none, auto, required or a function, got {value!r}")
        if value == "required" and not has_tools:
            raise InvalidRequestError("tool_choice", "required needs tools")
        return ChoiceMode(value), None
    if not isinstance(value, dict) or value.get("type") != "function" or set(value) != {"type", "function"}:
        raise InvalidRequestError("tool_choice", 'must be none, auto, required or {"type": "function", '
                                  '"function": {"name": ...}}')
    fn = value["function"]
    if not isinstance(fn, dict) or set(fn) != {"name"} or not isinstance(fn["name"], str):
        raise InvalidRequestError("tool_choice.function", "must be an object {name}")
    if not has_tools:
        raise InvalidRequestError("tool_choice", "a named function needs tools")
    return ChoiceMode.NAMED, fn["name"]


# ---------------------------------------------------------------------- the conversation


_ROLE_KEYS = {"system": {"role", "content", "name"}, "user": {"role", "content", "name"},
              "assistant": {"role", "content", "name", "tool_calls", "refusal"},
              "tool": {"role", "content", "tool_call_id", "name"}}


def message_keys(role: Any) -> set[str]:
    """The fields a message of this role may have (an unknown role: the common ones)."""
    return _ROLE_KEYS.get(role, {"role", "content", "name"}) if isinstance(role, str) else {"role", "content", "name"}


def calls_of(value: Any, field: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` in HF's template convention: arguments as an object
    (a template writes them with `tojson`; arguments that are no JSON object stay text); the
    id kept for formats that echo it."""
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(field, "must be a non-empty list of {id, type: function, function}")
    return [_call(call, f"{field}[{i}]") for i, call in enumerate(value)]


def _call(call: Any, field: str) -> dict[str, Any]:
    if not isinstance(call, dict) or set(call) - _CALL_KEYS:
        raise InvalidRequestError(field, "must be an object {id, type: function, function: {name, arguments}}")
    if call.get("type") not in (None, "function") or not isinstance(call.get("id"), (str, type(None))):
        raise InvalidRequestError(field, "must have type function and a string id")
    fn = call.get("function")
    if not isinstance(fn, dict) or set(fn) - {"name", "arguments"} or not isinstance(fn.get("name"), str):
        raise InvalidRequestError(f"{field}.function", "must be an object {name, arguments}")
    return {"id": call.get("id") or "", "type": "function",
            "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"), f"{field}.function")}}


def _arguments(value: Any, field: str) -> dict[str, Any] | str:
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, dict) else value
    raise InvalidRequestError(f"{field}.arguments", "must be a JSON object or its JSON text")


def tools_json(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    return [t.openai_json() for t in tools]
