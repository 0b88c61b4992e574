"""Each family's tool-call format on its own (api/tool_formats.py, api/tool_stream.py): what it
writes is what it parses, its grammar accepts exactly that (nested pydantic models with `$defs`
too), a stream split at every character sends the same content and calls as the whole answer,
and what only looks like a call is kept as content."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pydantic
import pytest

from halfmoon.api.tool_formats import FORMATS, choose, token_literal
from halfmoon.api.tool_stream import ToolStream
from halfmoon.api.tools import from_openai
from halfmoon.core.errors import InvalidRequestError
from halfmoon.core.params import Constraint, ConstraintKind
from halfmoon.engine.grammar import Grammars
from halfmoon.engine.tokenizer import Tokenizer


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    home: Address
    kind: Literal["a", "b"]


TOOL = {"type": "function", "function": {"name": "save", "parameters": Person.model_json_schema()}}
CALL = {"function": {"name": "save", "arguments": {"name": "Ann", "home": {"city": "Oslo"}, "kind": "a"}}}
CALL2 = {"function": {"name": "save", "arguments": {"name": "Bo", "home": {"city": "Rome"}, "kind": "b"}}}


@pytest.fixture(scope="module")
def tokenizer(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def grammars(tokenizer: Tokenizer) -> Grammars:
    return Grammars(tokenizer, tokenizer.vocab_size)


def names_and_arguments(calls: tuple) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_what_a_format_writes_it_parses_and_its_grammar_accepts(fmt: str, tokenizer: Tokenizer,
                                                                 grammars: Grammars) -> None:
    f = FORMATS[fmt]
    text = f.call_text([CALL, CALL2])
    assert names_and_arguments(f.parse(text).calls) == [("save", CALL["function"]["arguments"]),
                                                         ("save", CALL2["function"]["arguments"])]
    for parallel in (True, False):
        tools = from_openai({"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": parallel})
        compiled = grammars.compile(Constraint(ConstraintKind.GRAMMAR, f.grammar(tools, token_literal(tokenizer.special_id))))
        for calls, ok in (([CALL], True), ([CALL, CALL2], parallel)):
            matcher = compiled.template.deep_copy()
            accepted = matcher.consume_tokens(tokenizer.encode(f.call_text(calls), add_bos=False))
            assert (accepted and matcher.is_accepting()) == ok, (fmt, parallel, len(calls))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_call_to_another_function_or_with_bad_arguments_is_refused(fmt: str, tokenizer: Tokenizer,
                                                                     grammars: Grammars) -> None:
    f = FORMATS[fmt]
    tools = from_openai({"tools": [TOOL], "tool_choice": "required"})
    compiled = grammars.compile(Constraint(ConstraintKind.GRAMMAR, f.grammar(tools, token_literal(tokenizer.special_id))))
    wrong = [{"function": {"name": "drop", "arguments": CALL["function"]["arguments"]}},
             {"function": {"name": "save", "arguments": {**CALL["function"]["arguments"], "kind": "z"}}},
             {"function": {"name": "save", "arguments": {**CALL["function"]["arguments"], "extra": 1}}}]
    for call in wrong:
        matcher = compiled.template.deep_copy()
        accepted = matcher.consume_tokens(tokenizer.encode(f.call_text([call]), add_bos=False))
        assert not (accepted and matcher.is_accepting()), (fmt, call)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_stream_cut_anywhere_sends_what_the_whole_answer_holds(fmt: str) -> None:
    f = FORMATS[fmt]
    prefix = "Let me look that up.\n" if f.marker is not None else ""
    for text in (prefix + f.call_text([CALL, CALL2]), "Just words, no call.", "  [not a call", "<tool_c", ""):
        whole = f.parse(text)
        for step in (1, 2, 5, 100):
            stream = ToolStream(f)
            deltas = [d for i in range(0, len(text), step) for d in stream.push(text[i:i + step])]
            deltas += stream.finish()
            content = "".join(d.get("content", "") for d in deltas)
            calls = [c for d in deltas for c in d.get("tool_calls", ()) if "id" in c]
            arguments = [c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", ()) if "id" not in c]
            assert [c["function"]["name"] for c in calls] == [c.name for c in whole.calls], (fmt, text, step)
            assert arguments == [c.arguments for c in whole.calls]
            assert content.strip() == whole.content.strip(), (fmt, text, step)
            assert [c["index"] for c in calls] == list(range(len(calls)))


@pytest.mark.parametrize(("fmt", "text"), [
    ("hermes", "<tool_call>\n{broken\n</tool_call>"),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": [1]}'),
    ("llama3_json", "{not json"),
    ("mistral", "[TOOL_CALLS]{oops"),
    ("pythonic", "[f(a={**x})]"),
    ("pythonic", "[f(1, 2)]"),
    ("pythonic", "[os.system('x')]"),
    ("pythonic", "[" * 500),
])
def test_what_only_looks_like_a_call_is_content(fmt: str, text: str) -> None:
    parsed = FORMATS[fmt].parse(text)
    assert parsed.calls == () and parsed.content == text


def test_the_format_follows_the_template_then_the_family() -> None:
    assert choose("{{ '<tool_call>' }}", "llama").name == "hermes"
    assert choose("[TOOL_CALLS]", "mistral").name == "mistral"
    assert choose("<|python_tag|>", "llama").name == "llama3_json"
    assert choose(None, "gemma3").name == "pythonic"
    assert choose("{{ messages }}", "llama").name == "hermes"
    assert choose("<tool_call>", "qwen2", "pythonic").name == "pythonic"
    with pytest.raises(InvalidRequestError):
        choose(None, "llama", "xml")


def test_pythonic_arguments_must_be_python_names() -> None:
    tools = from_openai({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"my-key": {"type": "string"}}}}}], "tool_choice": "required"})
    with pytest.raises(InvalidRequestError, match="my-key"):
        FORMATS["pythonic"].grammar(tools)
