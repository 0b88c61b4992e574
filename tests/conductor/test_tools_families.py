"""Tool calling on every family's tiny checkpoint with its template (tests/tool_templates.py),
served by the real front door over a co-located engine: the format is the family's (picked from
the template, or Gemma 3's family), tool_choice required / named answer a valid call in that
format, auto reads the family's own format from what the model wrote, streamed calls arrive
whole (Mistral's control-token marker kept), and tool turns go back through the template.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from halfmoon.api.chat import render
from halfmoon.api.tool_formats import FORMATS as FORMAT_OF, choose, token_literal
from halfmoon.api.tools import from_openai
from halfmoon.api.server import ServerConfig
from halfmoon.conductor.colocated import ColocatedBackend
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from tests.conductor.conftest import CLIENT_SLOS_ONLY, RunningApi, run_api
from tests.conftest import NUM_THREADS
from tests.tool_templates import FORMATS, write_family

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FAMILIES = ("qwen2", "llama", "mistral", "gemma3")
CITY = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 3}},
    "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
TOOLS = [CITY, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class Served:
    def __init__(self, name: str, folder: Path) -> None:
        self.name = name
        write_family(name, folder)
        self.engine = Engine(EngineConfig(model=str(folder), num_blocks=192, num_threads=NUM_THREADS))
        backend = ColocatedBackend(self.engine, name, max_waiting=16, admission=CLIENT_SLOS_ONLY)
        self.api: RunningApi = run_api(backend, ServerConfig(grpc_port=0, http_port=0))
        self.client = openai.OpenAI(base_url=self.api.http_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module", params=FAMILIES)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = Served(request.param, tmp_path_factory.mktemp("tools") / request.param)
    yield s
    s.api.stop()


def ask(text: str = "Weather in Oslo?") -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def check(calls: list, allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.function.name in allowed and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_the_format_is_the_familys(served: Served) -> None:
    tokenizer = served.engine.tokenizer
    assert choose(tokenizer.chat_template, served.engine.model_config.architecture).name == FORMATS[served.name]
    assert tokenizer.takes_tools == (served.name != "gemma3")


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_answer_a_valid_call_in_the_familys_format(served: Served, choice: str) -> None:
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    allowed = {"get_weather", "get_time"} if choice == "required" else {"get_time"}
    for seed in range(4):
        done = served.client.chat.completions.create(model=served.name, messages=ask(), tools=TOOLS,
                                                     tool_choice=tool_choice, parallel_tool_calls=False,
                                                     temperature=0.9, seed=seed, max_tokens=120)
        c = done.choices[0]
        assert c.finish_reason == "tool_calls", c
        check(c.message.tool_calls, allowed)


def test_auto_reads_the_familys_format_from_what_the_model_wrote(served: Served) -> None:
    """The model is held (by a grammar the client sends) to write a call in its family's format;
    tool_choice auto finds it there, streaming and not."""
    fmt = FORMAT_OF[FORMATS[served.name]]
    grammar = fmt.grammar(from_openai({"tools": [CITY], "tool_choice": "required", "parallel_tool_calls": False}),
                          token_literal(served.engine.tokenizer.special_id))
    kwargs = dict(model=served.name, messages=ask(), tools=TOOLS, temperature=0.9, seed=7, max_tokens=120,
                  extra_body={"structured_outputs": {"grammar": grammar}})
    whole = served.client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    check(whole.message.tool_calls, {"get_weather"})
    with served.client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert streamed.finish_reason == "tool_calls" and not streamed.message.content


EXPECTED_TURNS = {
    "qwen2": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
              "<tool_response>\n{\"temp\": 3}\n</tool_response>", "<tools>\n"],
    "llama": ['{"name": "get_weather", "parameters": {"city": "Oslo"}}', "<|start_header_id|>ipython",
              "Environment: ipython"],
    "mistral": ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "abc123XYZ"}]',
                '[TOOL_RESULTS]{"content": "{\\"temp\\": 3}", "call_id": "abc123XYZ"}[/TOOL_RESULTS]',
                "[AVAILABLE_TOOLS]"],
    "gemma3": ['[get_weather(city="Oslo")]', '```tool_output\n{"temp": 3}\n```', "You have access to functions"],
}


def test_tool_turns_go_back_through_the_template(served: Served) -> None:
    messages = [*ask(), {"role": "assistant", "content": "", "tool_calls": [
        {"id": "abc123XYZ", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "tool_call_id": "abc123XYZ", "content": '{"temp": 3}'}]
    tokenizer = served.engine.tokenizer
    fmt = choose(tokenizer.chat_template, served.engine.model_config.architecture)
    text = render(tokenizer, messages, from_openai({"tools": TOOLS}), fmt)
    for needle in EXPECTED_TURNS[served.name]:
        assert needle in text, (needle, text)
    done = served.client.chat.completions.create(model=served.name, messages=messages, tools=TOOLS, max_tokens=4)
    assert done.usage.prompt_tokens == len(tokenizer.encode(text))  # the HTTP request renders the same
