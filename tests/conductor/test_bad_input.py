"""Malformed requests through both APIs: each gets its documented status and a message naming
the field; the server keeps serving and leaks nothing.

Each case has a gRPC form (GenerateRequest fields, or raw bytes) and an HTTP form (endpoint and
JSON body, or raw bytes), the status each API documents (conductor/errors.py), and the field
(or, where there is none, a phrase) the message must name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from halfmoon.v1 import generation_pb2 as pb
from tests.conductor.conftest import MODEL, RunningApi

INVALID = grpc.StatusCode.INVALID_ARGUMENT
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
LONG_PROMPT = "hello " * 9000  # ~9000 tokens: over the default 8192-token limit
HUGE = "x" * (5 * 2**20)  # over the default 4 MiB request limit


@dataclass(frozen=True)
class Case:
    name: str
    grpc: dict[str, Any] | bytes
    http: tuple[str, dict[str, Any] | bytes]
    grpc_code: grpc.StatusCode
    http_code: int
    grpc_field: str | None  # the field the gRPC error names (None: see `phrase`)
    http_field: str | None
    phrase: str = ""  # text both messages contain when no field applies


def c(name: str, g: dict | bytes, h: tuple[str, dict | bytes], gf: str | None, hf: str | None,
      code: grpc.StatusCode = INVALID, http: int = 400, phrase: str = "") -> Case:
    return Case(name, g, h, code, http, gf, hf, phrase)


def body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **kw}


CASES = [
    c("empty prompt", {"prompt": ""}, (COMPLETIONS, body(prompt="")), "prompt", "prompt"),
    c("no prompt at all", {}, (CHAT, {"model": MODEL}), "prompt", "messages"),
    c("prompt and messages", {"prompt": "hi", "messages": [pb.ChatMessage(role="user", content="hi")]},
      (COMPLETIONS, body(messages=USER)), "prompt", "messages"),
    c("unknown model", {"prompt": "hi", "model": "gpt-9"}, (COMPLETIONS, body(model="gpt-9")), "model", "model",
      grpc.StatusCode.NOT_FOUND, 404),
    c("missing model (HTTP requires it)", {"prompt": "hi", "model": " "}, (COMPLETIONS, {"prompt": "hi"}),
      "model", "model", grpc.StatusCode.NOT_FOUND, 400),
    c("bad role", {"messages": [pb.ChatMessage(role="wizard", content="hi")]},
      (CHAT, chat(messages=[{"role": "wizard", "content": "hi"}])), "messages[0].role", "messages[0].role"),
    c("empty role", {"messages": [pb.ChatMessage(role="", content="hi")]},
      (CHAT, chat(messages=[{"content": "hi"}])), "messages[0].role", "messages[0].role"),
    c("empty messages", {"prompt_token_ids": []}, (CHAT, chat(messages=[])), "prompt", "messages"),
    c("non-UTF-8 bytes", b"\x12\x02\xff\xfe", (COMPLETIONS, b'{"model": "smollm2", "prompt": "\xff\xfe"}'),
      "request", "body"),
    c("not a message / not JSON", b"\xff\xff\xff", (COMPLETIONS, b'{"model": "smollm2", "prompt":'),
      "request", "body"),
    c("huge max_tokens", {"prompt": "hi", "max_tokens": 10**6}, (COMPLETIONS, body(max_tokens=10**6)),
      "max_tokens", "max_tokens"),
    c("zero max_tokens", {"prompt": "hi", "max_tokens": 0}, (COMPLETIONS, body(max_tokens=0)),
      "max_tokens", "max_tokens"),
    c("negative temperature", {"prompt": "hi", "sampling": pb.SamplingParams(temperature=-0.5)},
      (COMPLETIONS, body(temperature=-0.5)), "sampling.temperature", "temperature"),
    c("NaN temperature", {"prompt": "hi", "sampling": pb.SamplingParams(temperature=math.nan)},
      (COMPLETIONS, b'{"model": "smollm2", "prompt": "hi", "temperature": NaN}'),
      "sampling.temperature", "temperature"),
    c("temperature of the wrong type", {"prompt": "hi", "sampling": pb.SamplingParams(temperature=math.inf)},
      (COMPLETIONS, body(temperature="hot")), "sampling.temperature", "temperature"),
    c("top_p 0", {"prompt": "hi", "sampling": pb.SamplingParams(top_p=0.0)}, (COMPLETIONS, body(top_p=0)),
      "sampling.top_p", "top_p"),
    c("top_p > 1", {"prompt": "hi", "sampling": pb.SamplingParams(top_p=1.5)}, (CHAT, chat(top_p=1.5)),
      "sampling.top_p", "top_p"),
    c("negative top_k", {"prompt": "hi", "sampling": pb.SamplingParams(top_k=-5)}, (CHAT, chat(top_k=-5)),
      "sampling.top_k", "top_k"),
    c("seed out of range", {"prompt": "hi", "sampling": pb.SamplingParams(seed=2**64 - 1)},
      (COMPLETIONS, body(seed=-1)), "sampling.seed", "seed"),
    c("stop list too long", {"prompt": "hi", "stop": [str(i) for i in range(17)]},
      (CHAT, chat(stop=[str(i) for i in range(17)])), "stop", "stop"),
    c("empty stop string", {"prompt": "hi", "stop": [""]}, (CHAT, chat(stop=[""])), "stop", "stop"),
    c("prompt over the limit", {"prompt": LONG_PROMPT}, (COMPLETIONS, body(prompt=LONG_PROMPT)),
      "prompt", "prompt"),
    c("token id outside the vocabulary", {"prompt_token_ids": [1, 2, 10**7]},
      (COMPLETIONS, body(prompt=[1, 2, 10**7])), "prompt_token_ids", "prompt"),
    c("negative token id", {"prompt_token_ids": [-3]}, (COMPLETIONS, body(prompt=[-3])),
      "prompt_token_ids", "prompt"),
    c("stop token id outside the vocabulary", {"prompt": "hi", "stop_token_ids": [10**7]},
      (CHAT, chat(stop_token_ids=[10**7])), "stop_token_ids", "stop_token_ids"),
    c("negative SLO", {"prompt": "hi", "slo": pb.Slo(ttft_ms=-1)}, (CHAT, chat(slo={"ttft_ms": -1})),
      "slo.ttft_ms", "slo.ttft_ms"),
    c("request id too long", {"prompt": "hi", "request_id": "r" * 500}, (CHAT, chat(request_id="r" * 500)),
      "request_id", "request_id"),
    c("cache_salt not printable", {"prompt": "hi", "cache_salt": "a\x00b"}, (CHAT, chat(cache_salt="a\x00b")),
      "cache_salt", "cache_salt"),
    c("unsupported OpenAI feature / unknown field", {"prompt": "hi", "sampling": pb.SamplingParams(top_p=-1)},
      (CHAT, chat(functions=[{"name": "f"}])), "sampling.top_p", "functions"),
    c("oversized body", {"prompt": HUGE}, (COMPLETIONS, body(prompt=HUGE)), None, None,
      grpc.StatusCode.RESOURCE_EXHAUSTED, 413, phrase="larger than"),
]


def grpc_call(api: RunningApi, request: dict[str, Any] | bytes, metadata: list | None = None) -> grpc.RpcError:
    raw = request if isinstance(request, bytes) else pb.GenerateRequest(**request).SerializeToString()
    with grpc.insecure_channel(api.grpc_target) as channel:
        call = channel.unary_stream("/halfmoon.v1.Generation/Generate", request_serializer=lambda b: b,
                                    response_deserializer=pb.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            list(call(raw, metadata=metadata, timeout=60))
    return err.value


def http_call(api: RunningApi, path: str, payload: dict[str, Any] | bytes,
              headers: dict[str, str] | None = None) -> httpx.Response:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return httpx.post(api.http_url + path, content=data, timeout=60,
                      headers={"Content-Type": "application/json", **(headers or {})})


def grpc_field(error: grpc.RpcError) -> str | None:
    status = rpc_status.from_call(error)
    for d in status.details if status else ():
        if d.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            d.Unpack(bad)
            return bad.field_violations[0].field
    return None


def test_there_are_at_least_25_cases() -> None:
    assert len(CASES) >= 25 and len({case.name for case in CASES}) == len(CASES)


def test_the_oversized_case_is_over_the_limit(api: RunningApi) -> None:
    assert len(HUGE) > 4 * 2**20
    assert len(api.engine.tokenizer.encode(LONG_PROMPT)) > 8192


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_grpc_rejects_with_the_documented_status(api: RunningApi, case: Case) -> None:
    error = grpc_call(api, case.grpc)
    assert error.code() == case.grpc_code, error.details()
    if case.grpc_field is not None:
        assert case.grpc_field in error.details()
        assert grpc_field(error) == case.grpc_field
    else:
        assert case.phrase in error.details()


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_http_rejects_with_the_documented_status(api: RunningApi, case: Case) -> None:
    response = http_call(api, *case.http)
    assert response.status_code == case.http_code, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == case.http_code
    if case.http_field is not None:
        assert error["param"] == case.http_field and case.http_field in error["message"]
    else:
        assert case.phrase in error["message"]


def test_the_server_keeps_serving_and_leaks_nothing(api: RunningApi) -> None:
    for case in CASES[:8]:  # a burst of bad requests in a row, then a good one on each API
        grpc_call(api, case.grpc)
        http_call(api, *case.http)
    ok = http_call(api, COMPLETIONS, body(max_tokens=2))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    with grpc.insecure_channel(api.grpc_target) as channel:
        call = channel.unary_stream("/halfmoon.v1.Generation/Generate",
                                    request_serializer=pb.GenerateRequest.SerializeToString,
                                    response_deserializer=pb.GenerateResponse.FromString)
        assert list(call(pb.GenerateRequest(prompt="hi", max_tokens=2)))[-1].final.usage.completion_tokens == 2
    assert api.wait_idle() == []
    assert api.backend.stats().requests_running == 0


@pytest.fixture(scope="module")
def guarded(start_api, tmp_path_factory: pytest.TempPathFactory) -> RunningApi:
    """One token-protected server for all the auth cases."""
    tokens = tmp_path_factory.mktemp("auth") / "tokens"
    tokens.write_text("the-token\n")
    return start_api(api_token_file=str(tokens))


@pytest.mark.parametrize("token", [None, "Bearer wrong", "Basic c2VjcmV0", "Bearer"])
def test_missing_or_wrong_auth_on_both_apis(guarded: RunningApi, token: str | None) -> None:
    metadata = None if token is None else [("authorization", token)]
    error = grpc_call(guarded, {"prompt": "hi"}, metadata)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "token" in error.details()
    response = http_call(guarded, CHAT, chat(), {} if token is None else {"Authorization": token})
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    assert "token" in response.json()["error"]["message"]
