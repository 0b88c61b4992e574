"""Structured outputs through the front door (issue 47): the official OpenAI client's `parse`
with a pydantic model, response_format json_object / json_schema, vLLM's `structured_outputs`
(regex, choice, grammar, json), the gRPC `constraint`, the SDK and `halfmoon client`; an
unimplemented schema keyword is a 400 naming it."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Literal

import grpc
import httpx
import openai
import pydantic
import pytest

from halfmoon.client import Client, InvalidArgumentError
from tests.conductor.conftest import MODEL, RunningApi
from tests.engine.constraint_cases import CHOICES, REGEXES, SCHEMAS, check

pytestmark = [pytest.mark.slow]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]


def oai(api: RunningApi) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.http_url + "/v1", api_key="unused", max_retries=0)


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_the_openai_client_parses_into_a_pydantic_model(api: RunningApi) -> None:
    done = oai(api).chat.completions.parse(model=MODEL, messages=ask("Describe a person as JSON."),
                                           response_format=Person, max_tokens=80, temperature=0.9, seed=3)
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Person)


def test_json_object_and_json_schema_streaming_and_not(api: RunningApi) -> None:
    client = oai(api)
    obj = client.chat.completions.create(model=MODEL, max_tokens=60, response_format={"type": "json_object"},
                                         messages=ask('Reply with a JSON object with one key "ok" set to true.'))
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].message.content), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMAS["order"], "strict": True}}
    stream = client.chat.completions.create(model=MODEL, messages=ask("Write an order as JSON."), max_tokens=120,
                                            response_format=fmt, stream=True, temperature=0.9, seed=5, n=3)
    texts, finish = ["", "", ""], ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    for text, reason in zip(texts, finish):
        if reason == "stop":
            check("order", text)
    assert "stop" in finish


@pytest.mark.parametrize("name", ["phone", "color", "choice"])
def test_structured_outputs_regex_and_choice_on_completions(api: RunningApi, name: str) -> None:
    so = {"choice": CHOICES} if name == "choice" else {"regex": REGEXES[name]}
    out = oai(api).completions.create(model=MODEL, prompt="Answer: ", max_tokens=30, temperature=0.9, seed=2,
                                      extra_body={"structured_outputs": so})
    assert out.choices[0].finish_reason == "stop"
    check(name, out.choices[0].text)


def test_a_grammar_and_a_json_schema_by_structured_outputs(api: RunningApi) -> None:
    grammar = 'start: "The answer is " ("yes" | "no") "."'
    out = oai(api).completions.create(model=MODEL, prompt="Q: is water wet?\nA:", max_tokens=20,
                                      extra_body={"structured_outputs": {"grammar": grammar}})
    assert out.choices[0].text in ("The answer is yes.", "The answer is no.")
    out = oai(api).chat.completions.create(model=MODEL, messages=ask("A person, as JSON."), max_tokens=80,
                                           extra_body={"structured_outputs": {"json": SCHEMAS["person"]}})
    check("person", out.choices[0].message.content)
    # the fields come in the schema's order (name, age, role: not sorted), as pydantic models list them
    assert list(json.loads(out.choices[0].message.content)) == list(SCHEMAS["person"]["properties"])


@pytest.mark.parametrize("body, param, phrase", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}, "response_format", "uniqueItems"),
    ({"structured_outputs": {"json": {"type": "object", "not": {"required": ["a"]}}}}, "structured_outputs", "not"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs", "grammar"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "description": True}}},
     "response_format.json_schema.description", "string"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs", "not both"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"json": {}, "regex": None}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object", "true"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "non-empty"),
])
def test_what_cannot_be_enforced_is_a_400_naming_it(api: RunningApi, body: dict, param: str, phrase: str) -> None:
    r = httpx.post(api.http_url + "/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": ask("hi"), "max_tokens": 5, **body})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and phrase in error["message"], error


def test_grpc_sdk_and_cli_constraints(api: RunningApi) -> None:
    with Client(api.grpc_target) as sdk:
        result = sdk.generate(messages=ask("A person as JSON."), max_tokens=80, json_schema=SCHEMAS["person"])
        assert result.finish_reason == "stop"
        check("person", result.text)
        picked = sdk.generate("Pick one:", max_tokens=10, choice=CHOICES, temperature=1.0, seed=4)
        assert picked.text in CHOICES
        with pytest.raises(InvalidArgumentError) as refused:
            sdk.generate("x", max_tokens=5, json_schema={"type": "string", "format": "bogus"})
        assert refused.value.field == "constraint.json_schema" and "bogus" in refused.value.message
    done = subprocess.run([sys.executable, "-m", "halfmoon.cli.main", "client", "generate", "--target",
                           api.grpc_target, "Answer:", "--max-tokens", "20",
                           "--regex", REGEXES["phone"], "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    check("phone", json.loads(done.stdout)["text"])


def test_a_raw_grpc_constraint_error_is_invalid_argument(api: RunningApi) -> None:
    from halfmoon.v1 import generation_pb2 as pb
    from halfmoon.v1 import generation_pb2_grpc as pb_grpc

    req = pb.GenerateRequest(prompt="x", max_tokens=3, constraint=pb.Constraint(json_schema="{not json"))
    with grpc.insecure_channel(api.grpc_target) as ch, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.GenerationStub(ch).Generate(req, timeout=30))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "constraint.json_schema" in e.value.details()
