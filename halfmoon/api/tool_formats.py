"""How each model family writes a tool call, reads a tool's result, and is told about tools.

    format       families (auto)                          a call, as the model writes it
    hermes       Qwen 2.5 / 3, and any template without    <tool_call>
                 a tool format of its own (SmolLM2)        {"name": "f", "arguments": {...}}
                                                           </tool_call>      (one per call)
    llama3_json  Llama 3.1 / 3.2 / 3.3                     {"name": "f", "parameters": {...}}
                                                           (calls joined by "; "; an optional
                                                           leading <|python_tag|>)
    mistral      Mistral (v3 tokenizers)                   [TOOL_CALLS][{"name": "f",
                                                           "arguments": {...}}, ...]
    pythonic     Gemma 3                                   [f(city="Paris", days=3), g()]
                                                           (optionally in a ```tool_code block)

`choose` picks the format from the chat template's own markers (`<tool_call>`, `[TOOL_CALLS]`,
`<|python_tag|>`), else from the family (Gemma 3: pythonic), else Hermes; `--tool-call-parser`
overrides it. A template that takes `tools` renders them itself; for one that does not (SmolLM2's,
Gemma 3's), the format's `preamble` goes into the system turn and tool turns are written in the
format's text (api/chat.py).

Each format also writes the grammar that `tool_choice` required / named holds the output to
(llguidance's Lark, arguments as `%json` of the function's `parameters`): the answer is a call,
to an allowed function, whose arguments validate.
"""

from __future__ import annotations

import ast
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from halfmoon.api.tools import Tool, ToolCall, ToolRequest, new_call_id
from halfmoon.core.errors import InvalidRequestError
from halfmoon.engine.grammar import strict_objects

# The JSON layout the grammar writes arguments in (json.dumps's): a small model let loose on
# "any whitespace" can pad forever.
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_PARALLEL_CALLS = 8  # calls in one answer held to a grammar (tool_choice required, parallel)

# A tool call's marker as the grammar spells it: a special token by id (`<[id]>`), else text.
Literal = Callable[[str], str]


@dataclass(frozen=True, slots=True)
class Parsed:
    """An answer split into its text and its calls (no calls: the whole text is content)."""

    content: str
    calls: tuple[ToolCall, ...] = ()


def text_literal(text: str) -> str:
    return json.dumps(text)


def token_literal(special_id: Callable[[str], int | None]) -> Literal:
    """Markers spelled as the tokenizer has them: a special token by id, else as text."""
    def literal(text: str) -> str:
        i = special_id(text)
        return text_literal(text) if i is None else f"<[{i}]>"

    return literal


def _json_rule(schema: Mapping[str, Any]) -> str:
    """`%json` of a schema, in the layout clients parse."""
    return "%json " + json.dumps({**schema, "x-guidance": _LAYOUT})


_DEFS = ("$defs", "definitions")


def _call_object(parameters: dict[str, Any], name: str, arguments_key: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": name}, arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False}


def _one_of_calls(tools: Sequence[Tool], arguments_key: str) -> dict[str, Any]:
    """One call to any of `tools`, as a JSON schema. Each function's `$defs` move to the root
    (where its `#/$defs/...` references resolve once its parameters sit inside a call)."""
    defs: dict[str, dict[str, Any]] = {}
    objects = [_call_object(_hoist(strict_objects(t.schema), t.name, defs), t.name, arguments_key) for t in tools]
    schema = objects[0] if len(objects) == 1 else {"anyOf": objects}
    return {**schema, **{k: v for k, v in defs.items() if v}}


def _hoist(schema: dict[str, Any], name: str, defs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`schema` without its `$defs` / `definitions`, which join `defs` (a name two tools define
    differently cannot be told apart: a 400)."""
    out = dict(schema)
    for key in _DEFS:
        found = out.pop(key, None)
        if not isinstance(found, dict):
            continue
        merged = defs.setdefault(key, {})
        for ref, value in found.items():
            if merged.setdefault(ref, value) != value:
                raise InvalidRequestError("tools", f"{name}: {key}/{ref} is defined differently by another tool")
    return out


def _repeated(item: str, separator: str, parallel: bool) -> str:
    """One `item`, or with parallel calls up to MAX_PARALLEL_CALLS of them: bounded, so that
    an answer held to the grammar always ends (a small model may otherwise call forever)."""
    if not parallel:
        return item
    more = ""
    for _ in range(MAX_PARALLEL_CALLS - 1):
        more = f"({text_literal(separator)} {item} {more})?".replace(" )", ")")
    return f"{item} {more}"


def _json_objects(text: str) -> list[Any] | None:
    """JSON values one after another, separated by ";" and/or whitespace (None: not that)."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return out
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


def _call_of(obj: Any, keys: tuple[str, ...]) -> ToolCall | None:
    """{"name": str, <one of keys>: object} -> a call (None: not one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[k] for k in keys if k in obj), {})
    if isinstance(arguments, str):  # some fine-tunes write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(arguments, ensure_ascii=False))


class ToolFormat(ABC):
    """One family's tool-call format (see the module docstring)."""

    name: ClassVar[str]
    marker: ClassVar[str | None] = None  # the text a call starts with, wherever it appears
    leading: ClassVar[tuple[str, ...]] = ()  # or: what an answer that is calls starts with

    @abstractmethod
    def preamble(self, tools: Sequence[Tool]) -> str:
        """What a system turn says of the tools, for a template that does not render them."""

    @abstractmethod
    def call_text(self, calls: Sequence[Mapping[str, Any]]) -> str:
        """An assistant turn's calls (HF's shape: {function: {name, arguments: object}}) as
        the model writes them."""

    def result_text(self, content: str) -> str:
        """A tool's result as the user turn that brings it back."""
        return content

    @abstractmethod
    def parse(self, text: str) -> Parsed:
        """A whole answer's text and calls."""

    @abstractmethod
    def grammar(self, request: ToolRequest, literal: Literal = text_literal) -> str:
        """The Lark grammar `tool_choice` required / named holds an answer to."""

    def split(self, text: str, at_start: bool) -> tuple[int, bool]:
        """Streaming: how much of `text` (what is not yet sent) is surely content, and whether
        a call starts right after it. `at_start`: nothing was sent yet."""
        if self.marker is not None:
            i = text.find(self.marker)
            if i >= 0:
                return i, True
            return len(text) - _partial_suffix(text, self.marker), False
        if not at_start:
            return len(text), False
        head = text.lstrip()
        if any(head.startswith(s) for s in self.leading):
            return 0, True
        if any(s.startswith(head) for s in self.leading):  # empty, or a starter's beginning
            return 0, False
        return len(text), False


def _partial_suffix(text: str, marker: str) -> int:
    """The longest end of `text` that is a beginning of `marker` (held back while streaming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _tools_lines(tools: Sequence[Tool]) -> str:
    return "\n".join(json.dumps(t.openai_json(), ensure_ascii=False) for t in tools)


class Hermes(ToolFormat):
    name = "hermes"
    marker = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def preamble(self, tools: Sequence[Tool]) -> str:
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
                f"{_tools_lines(tools)}\n</tools>\n\nFor each function call, return a json object with function "
                "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def call_text(self, calls: Sequence[Mapping[str, Any]]) -> str:
        return "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                       "arguments": c["function"]["arguments"]},
                                                      ensure_ascii=False) + "\n</tool_call>" for c in calls)

    def result_text(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def parse(self, text: str) -> Parsed:
        start = text.find(self.marker)
        if start < 0:
            return Parsed(text)
        calls = []
        for block in self._BLOCK.findall(text, start):
            objs = _json_objects(block)
            call = _call_of(objs[0], ("arguments", "parameters")) if objs and len(objs) == 1 else None
            if call is None:
                return Parsed(text)  # not a call after all: nothing is lost
            calls.append(call)
        return Parsed(text[:start].rstrip(), tuple(calls))

    def grammar(self, request: ToolRequest, literal: Literal = text_literal) -> str:
        call = f'{literal("<tool_call>")} "\\n" {_json_rule(_one_of_calls(request.allowed, "arguments"))} ' \
               f'"\\n" {literal("</tool_call>")}'
        return f"start: {_repeated('call', chr(10), request.many)}\ncall: {call}\n"


class Llama3Json(ToolFormat):
    name = "llama3_json"
    leading = ("{", "<|python_tag|>")

    def preamble(self, tools: Sequence[Tool]) -> str:
        return ("Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\nRespond in the format "
                '{"name": function name, "parameters": dictionary of argument name and its value}. '
                f"Do not use variables.\n\n{_tools_lines(tools)}")

    def call_text(self, calls: Sequence[Mapping[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": c["function"]["name"], "parameters": c["function"]["arguments"]},
                                    ensure_ascii=False) for c in calls)

    def parse(self, text: str) -> Parsed:
        body = text.strip().removeprefix("<|python_tag|>")
        if not body.startswith("{"):
            return Parsed(text)
        objs = _json_objects(body)
        calls = [_call_of(o, ("parameters", "arguments")) for o in objs or []]
        if not calls or any(c is None for c in calls):
            return Parsed(text)
        return Parsed("", tuple(c for c in calls if c is not None))

    def grammar(self, request: ToolRequest, literal: Literal = text_literal) -> str:
        call = _json_rule(_one_of_calls(request.allowed, "parameters"))
        return f"start: {_repeated('call', '; ', request.many)}\ncall: {call}\n"


class Mistral(ToolFormat):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def preamble(self, tools: Sequence[Tool]) -> str:
        listed = json.dumps([t.openai_json() for t in tools], ensure_ascii=False)
        return (f"[AVAILABLE_TOOLS]{listed}[/AVAILABLE_TOOLS]\nTo call functions, answer "
                '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}, ...]')

    def call_text(self, calls: Sequence[Mapping[str, Any]]) -> str:
        return self.marker + json.dumps([{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                         for c in calls], ensure_ascii=False)

    def result_text(self, content: str) -> str:
        return f"[TOOL_RESULTS]{json.dumps({'content': content}, ensure_ascii=False)}[/TOOL_RESULTS]"

    def parse(self, text: str) -> Parsed:
        start = text.find(self.marker)
        if start < 0:
            return Parsed(text)
        objs = _json_objects(text[start + len(self.marker):])
        items = objs[0] if objs and len(objs) == 1 else None
        items = [items] if isinstance(items, dict) else items
        calls = [_call_of(o, ("arguments", "parameters")) for o in items or []]
        if not calls or any(c is None for c in calls):
            return Parsed(text)
        return Parsed(text[:start].rstrip(), tuple(c for c in calls if c is not None))

    def grammar(self, request: ToolRequest, literal: Literal = text_literal) -> str:
        call = _one_of_calls(request.allowed, "arguments")
        defs = {k: call.pop(k) for k in _DEFS if k in call}  # references resolve at the root
        array = {"type": "array", "items": call, "minItems": 1, **defs}
        if not request.many:
            array["maxItems"] = 1
        return f"start: {literal(self.marker)} {_json_rule(array)}\n"


class Pythonic(ToolFormat):
    """Calls as a Python list of keyword calls; values are written as JSON (a string, a number,
    a list, an object), which is Python too except true / false / null, read either way."""

    name = "pythonic"
    leading = ("[", "```tool_code")
    _LITERALS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}

    def preamble(self, tools: Sequence[Tool]) -> str:
        return ("You have access to functions. If you decide to invoke any of the function(s), you MUST put it "
                "in the format of\n[func_name1(params_name1=params_value1, params_name2=params_value2...), "
                "func_name2(params)]\n\nYou SHOULD NOT include any other text in the response if you call a "
                f"function\n{_tools_lines(tools)}")

    def call_text(self, calls: Sequence[Mapping[str, Any]]) -> str:
        def one(c: Mapping[str, Any]) -> str:
            arguments = c["function"]["arguments"]
            if isinstance(arguments, str):  # a client's arguments that are no JSON object: as sent
                return f"{c['function']['name']}({arguments})"
            args = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in arguments.items())
            return f"{c['function']['name']}({args})"

        return "[" + ", ".join(one(c) for c in calls) + "]"

    def result_text(self, content: str) -> str:
        return f"```tool_output\n{content}\n```"

    def parse(self, text: str) -> Parsed:
        body = text.strip()
        if body.startswith("```tool_code"):
            body = body.removeprefix("```tool_code").removesuffix("```").strip()
        if not (body.startswith("[") and body.endswith("]")):
            return Parsed(text)
        try:
            tree = ast.parse(body, mode="eval").body
            calls = [self._call(node) for node in tree.elts] if isinstance(tree, ast.List) else []
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):  # whatever it wrote
            return Parsed(text)
        return Parsed("", tuple(calls)) if calls else Parsed(text)

    def _call(self, node: ast.AST) -> ToolCall:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise ValueError("not a keyword call")
        args = {kw.arg: self._value(kw.value) for kw in node.keywords if kw.arg is not None}
        if len(args) != len(node.keywords):
            raise ValueError("**kwargs")
        return ToolCall(new_call_id(), node.func.id, json.dumps(args, ensure_ascii=False))

    def _value(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Name) and node.id in self._LITERALS:
            return self._LITERALS[node.id]
        if isinstance(node, ast.List):
            return [self._value(v) for v in node.elts]
        if isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):
                raise ValueError("**mapping")
            return {self._value(k): self._value(v) for k, v in zip(node.keys, node.values, strict=True)}
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -self._value(node.operand)
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
            return node.value
        raise ValueError(f"not a literal: {ast.dump(node)[:60]}")

    def grammar(self, request: ToolRequest, literal: Literal = text_literal) -> str:
        rules = [f"start: \"[\" {_repeated('call', ', ', request.many)} \"]\"",
                 "call: " + " | ".join(f"call_{i}" for i in range(len(request.allowed)))]
        rules += [f"call_{i}: {_keyword_call(t)}" for i, t in enumerate(request.allowed)]
        return "\n".join(rules) + "\n"


def _keyword_call(tool: Tool) -> str:
    """`name(k1=v1, k2=v2)`: the schema's properties in its order, the required ones always,
    each value `%json` of the property's schema."""
    schema = strict_objects(tool.schema)
    props, required = schema.get("properties") or {}, schema.get("required") or []
    if not isinstance(props, dict) or not isinstance(required, list):
        raise InvalidRequestError("tools", f"{tool.name}: properties must be an object, required a list")
    bad = next((k for k in props if not k.isidentifier()), None)
    if bad is not None:
        raise InvalidRequestError("tools", f"{tool.name}: the pythonic format passes arguments by keyword, and "
                                  f"{bad!r} is no Python name")
    defs = {k: schema[k] for k in _DEFS if isinstance(schema.get(k), dict)}  # each value's references resolve
    args = [(f"{text_literal(k + '=')} {_json_rule({**(v if isinstance(v, dict) else {}), **defs})}", k in required)
            for k, v in props.items()]
    if not args:
        return text_literal(tool.name + "()")
    return f"{text_literal(tool.name + '(')} {_arguments(args)} \")\""


def _arguments(args: list[tuple[str, bool]]) -> str:
    """Keyword arguments in a fixed order, optional ones skippable, ", " between those given."""
    def rest(i: int) -> str:  # what follows an argument already written
        if i == len(args):
            return ""
        item, required = args[i]
        head = f'", " {item}' if required else f'(", " {item})?'
        return f"{head} {rest(i + 1)}".strip()

    alternatives = []
    for i, (item, required) in enumerate(args):  # the first argument written is i
        alternatives.append(f"{item} {rest(i + 1)}".strip())
        if required:
            break
    some = "(" + " | ".join(alternatives) + ")"
    return some if any(r for _, r in args) else some + "?"


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Llama3Json(), Mistral(), Pythonic())}
AUTO = "auto"
PARSERS = (AUTO, *FORMATS)


def choose(template: str | None, architecture: str, parser: str = AUTO) -> ToolFormat:
    """The format a model's answers are read in (see the module docstring)."""
    if parser != AUTO:
        if parser not in FORMATS:
            raise InvalidRequestError("tool_call_parser", f"{parser!r} is not one of {list(PARSERS)}")
        return FORMATS[parser]
    text = template or ""
    if "<tool_call>" in text:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in text:
        return FORMATS["mistral"]
    if "<|python_tag|>" in text or "ipython" in text:
        return FORMATS["llama3_json"]
    if architecture.startswith("gemma"):
        return FORMATS["pythonic"]
    return FORMATS["hermes"]
