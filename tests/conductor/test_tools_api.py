"""Tool calling through the HTTP front door (issue 47).

On SmolLM2-135M (its template takes no tools: the Hermes format's preamble tells it about them):
tool_choice required / named give a call to an allowed function whose arguments validate, every
time (the grammar), streaming or not, with the official OpenAI client; tool turns go back through
the template. Over a scripted backend (a fake model, named as such: it answers the text a test
gives it) the front door reads what a model wrote in auto mode: content, calls, both, streaming
deltas in OpenAI's shape, text that only looks like a call kept as content. Bad tool requests are
400s naming the field.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from halfmoon.api.server import ServerConfig
from halfmoon.results import ModelInfo
from tests.conductor.conftest import MODEL, RunningApi, ScriptedBackend, run_api

pytestmark = [pytest.mark.slow]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "pattern": "^[A-Z][a-z]{2,12}/[A-Z][a-z]{2,12}$"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "get_time"}}


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def check_calls(calls: list[Any], allowed: set[str]) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in allowed, call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# ---------------------------------------------------------------------- a real model


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_always_give_a_valid_call(api: RunningApi, choice: str) -> None:
    tool_choice, allowed = ("required", {"get_weather", "get_time"}) if choice == "required" else (NAMED, {"get_time"})
    client = oai(api.http_url)
    for seed in range(5):
        done = client.chat.completions.create(model=MODEL, messages=ask("What is the weather in Paris?"),
                                              tools=TOOLS, tool_choice=tool_choice, temperature=0.9, seed=seed,
                                              max_tokens=100, parallel_tool_calls=False)
        c = done.choices[0]
        assert c.finish_reason == "tool_calls", c
        assert c.message.content is None and len(c.message.tool_calls) == 1
        check_calls(c.message.tool_calls, allowed)


def test_required_with_parallel_calls_ends_within_its_bound(api: RunningApi) -> None:
    """parallel_tool_calls (the default): one or more calls, at most 8, so it ends."""
    client = oai(api.http_url)
    for seed in range(2):
        done = client.chat.completions.create(model=MODEL, messages=ask("Weather and time in Paris?"), tools=TOOLS,
                                              tool_choice="required", temperature=0.9, seed=seed, max_tokens=400)
        c = done.choices[0]
        assert c.finish_reason == "tool_calls", c
        assert 1 <= len(c.message.tool_calls) <= 8
        check_calls(c.message.tool_calls, {"get_weather", "get_time"})
        assert len({call.id for call in c.message.tool_calls}) == len(c.message.tool_calls)


def test_the_official_client_accumulates_streamed_tool_calls(api: RunningApi) -> None:
    client = oai(api.http_url)
    with client.chat.completions.stream(model=MODEL, messages=ask("Time in Berlin?"), tools=TOOLS,
                                        tool_choice=NAMED, temperature=0.9, seed=11, max_tokens=60) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    c = final.choices[0]
    assert c.finish_reason == "tool_calls", c
    check_calls(c.message.tool_calls, {"get_time"})
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert [e.name for e in done] == ["get_time"] and done[0].arguments == c.message.tool_calls[0].function.arguments


def test_a_conversation_with_calls_and_results_continues(api: RunningApi) -> None:
    """The assistant's call and the tool's result go back through the template; the model answers."""
    messages = [*ask("What is the weather in Paris?"),
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'}]
    done = oai(api.http_url).chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=12)
    c = done.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls") and (c.message.content or c.message.tool_calls)
    assert done.usage.prompt_tokens > 200  # the tools' preamble and both tool turns are in the prompt


def test_tool_choice_none_offers_no_tools(api: RunningApi) -> None:
    client = oai(api.http_url)
    plain = client.chat.completions.create(model=MODEL, messages=ask("Hi"), max_tokens=4)
    none = client.chat.completions.create(model=MODEL, messages=ask("Hi"), tools=TOOLS, tool_choice="none",
                                          max_tokens=4)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None


# ---------------------------------------------------------------------- bad requests


@pytest.mark.parametrize(("change", "field"), [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "9lives"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "tool", "content": "21"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function"),
    ({"messages": [{"role": "user", "content": "Hi", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "format": "ipv9"}}}}}], "tool_choice": "required"},
     "tools"),
])
def test_bad_tool_requests_are_400s_naming_the_field(api: RunningApi, change: dict[str, Any], field: str) -> None:
    body = {"model": MODEL, "messages": ask("Hi"), "max_tokens": 4, **change}
    r = httpx.post(api.http_url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.json()


# ---------------------------------------------------------------------- what a model wrote (scripted)


@pytest.fixture(scope="module")
def scripted_tools(shared_engine: Any) -> Iterator[RunningApi]:
    """A front door over a scripted backend (a fake model) with room for tool prompts."""
    model = ModelInfo(MODEL, shared_engine.max_model_len, shared_engine.model_config.vocab_size)
    running = run_api(ScriptedBackend(model, shared_engine.tokenizer, 4096), ServerConfig(grpc_port=0, http_port=0))
    yield running
    running.stop()


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Oslo"}}\n</tool_call>'


@pytest.mark.parametrize(("text", "content", "names"), [
    ("It is sunny.", "It is sunny.", []),
    (CALL, None, ["get_weather"]),
    (f"Let me check.\n{CALL}\n{CALL2}", "Let me check.", ["get_weather", "get_time"]),
    ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),  # kept, not lost
    ("I'd use <tool_ but no.", "I'd use <tool_ but no.", []),
])
def test_auto_reads_what_the_model_wrote_streaming_and_not(scripted_tools: RunningApi, text: str,
                                                           content: str | None, names: list[str]) -> None:
    client = oai(scripted_tools.http_url)
    backend = scripted_tools.backend
    backend.texts.append(text)
    whole = client.chat.completions.create(model=MODEL, messages=ask("Weather in Oslo?"), tools=TOOLS,
                                           max_tokens=200).choices[0]
    assert whole.message.content == content
    assert [c.function.name for c in whole.message.tool_calls or []] == names
    assert whole.finish_reason == ("tool_calls" if names else "stop")
    backend.texts.append(text)
    with client.chat.completions.stream(model=MODEL, messages=ask("Weather in Oslo?"), tools=TOOLS,
                                        max_tokens=200) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert (streamed.message.content or None) == content
    assert [c.function.name for c in streamed.message.tool_calls or []] == names
    assert [c.function.arguments for c in streamed.message.tool_calls or []] == \
        [c.function.arguments for c in whole.message.tool_calls or []]
    assert streamed.finish_reason == whole.finish_reason


def test_calls_stream_as_each_completes(scripted_tools: RunningApi) -> None:
    """The first call's deltas come before the second call's text has all arrived."""
    scripted_tools.backend.texts.append(f"{CALL}\n{CALL2}")
    body = {"model": MODEL, "messages": ask("Weather in Oslo?"), "tools": TOOLS, "max_tokens": 200, "stream": True}
    chunks = []
    with httpx.stream("POST", scripted_tools.http_url + "/v1/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line.removeprefix("data: ")))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert [c["index"] for c in calls] == [0, 0, 1, 1]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[0]["id"].startswith("call_")
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo", "unit": "celsius"}
    assert not any(d.get("content") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ---------------------------------------------------------------------- gRPC, the SDK, the CLI


def test_the_sdk_calls_tools_over_grpc(api: RunningApi) -> None:
    from halfmoon.client import Client

    with Client(api.grpc_target) as sdk:
        for seed in range(2):
            result = sdk.generate(messages=ask("Weather in Oslo?"), tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, temperature=0.9, seed=seed, max_tokens=100)
            assert result.finish_reason == "tool_calls" and len(result.tool_calls) == 1, result
            call = result.tool_calls[0]
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            assert result.content == "" and call.id.startswith("call_")
        flat = [t["function"] for t in TOOLS]  # the flat spelling works too
        chunks = list(sdk.stream(messages=ask("Time in Oslo?"), tools=flat, tool_choice="get_time",
                                 temperature=0.9, seed=3, max_tokens=60))
        final = chunks[-1].result
        assert final is not None and final.finish_reason == "tool_calls"
        assert [c.name for c in final.tool_calls] == ["get_time"]
        assert "".join(c.text for c in chunks) == final.text  # the stream is what the model wrote
        # the call and its result go back through the template, as over HTTP
        turns = [*ask("Time in Oslo?"), {"role": "assistant", "tool_calls": list(final.tool_calls)},
                 {"role": "tool", "tool_call_id": final.tool_calls[0].id, "content": "12:00"}]
        answer = sdk.generate(messages=turns, tools=TOOLS, max_tokens=4)
    http_turns = [*ask("Time in Oslo?"), {"role": "assistant", "content": None, "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in final.tool_calls]}, {"role": "tool", "tool_call_id": final.tool_calls[0].id, "content": "12:00"}]
    over_http = oai(api.http_url).chat.completions.create(model=MODEL, messages=http_turns, tools=TOOLS, max_tokens=4)
    assert answer.usage.prompt_tokens == over_http.usage.prompt_tokens > 200


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"tools": TOOLS, "tool_choice": "nope"}, "tool_choice.function.name"),
    ({"tools": [{"name": "f", "parameters": "{not json"}]}, "tools[0].parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tool_requests_are_invalid_argument_over_grpc(api: RunningApi, kwargs: dict[str, Any], field: str) -> None:
    from halfmoon.client import Client, InvalidArgumentError

    with Client(api.grpc_target) as sdk, pytest.raises(InvalidArgumentError) as caught:
        sdk.generate(messages=ask("Hi"), max_tokens=4, **kwargs)
    assert caught.value.field == field, caught.value


def test_halfmoon_client_chat_prints_the_calls(api: RunningApi, tmp_path: Any) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    done = subprocess.run([sys.executable, "-m", "halfmoon.cli.main", "client", "chat", "--target", api.grpc_target,
                           "Time in Oslo?", "--tools", f"@{tools}", "--tool-choice", "get_time", "--max-tokens", "60",
                           "--temperature", "0.9", "--seed", "5"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("--- tool call "))
    name, _, arguments = line.split(": ", 1)[1].partition("(")
    assert name == "get_time"
    jsonschema.validate(json.loads(arguments[:-1]), SCHEMAS["get_time"])
    assert "[tool_calls:" in done.stderr
