"""What the fuzzers found, each fixed at its cause, kept as a plain regression test against the
fuzzers' server (tests/fuzz/conftest.py: max_tokens limit 4, bearer auth on)."""

from __future__ import annotations

from typing import Any

import grpc
import httpx
import pytest

from halfmoon.v1 import generation_pb2 as pb
from tests.conductor.conftest import MODEL, RunningApi
from tests.fuzz.conftest import LIMITS, TOKEN

AUTH = {"Authorization": f"Bearer {TOKEN}"}
USER = [{"role": "user", "content": "hi"}]


def post(api: RunningApi, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{api.http_url}{path}", json=body, headers=AUTH, timeout=60)


def test_a_request_without_max_tokens_is_served_under_a_limit_below_the_default(fuzz_api: RunningApi) -> None:
    """Schemathesis: `{"model", "prompt"}` was a 400 "max_tokens must be in [1, 4], got 16" —
    the default (16) was checked against the server's limit instead of being held within it."""
    assert LIMITS.max_tokens < 16
    answer = post(fuzz_api, "/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "ignore_eos": True})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == LIMITS.max_tokens
    with grpc.insecure_channel(fuzz_api.grpc_target) as channel:
        call = channel.unary_stream("/halfmoon.v1.Generation/Generate",
                                    request_serializer=pb.GenerateRequest.SerializeToString,
                                    response_deserializer=pb.GenerateResponse.FromString)
        last = list(call(pb.GenerateRequest(prompt="Once upon a time", ignore_eos=True),
                         metadata=[("authorization", AUTH["Authorization"])], timeout=60))[-1]
    assert last.final.usage.completion_tokens == LIMITS.max_tokens


@pytest.mark.parametrize("field, value", [("echo", 0), ("n", True), ("logprobs", True), ("best_of", True)])
def test_a_neutral_openai_field_is_compared_as_json(fuzz_api: RunningApi, field: str, value: Any) -> None:
    """Schemathesis: `echo: 0` and `top_logprobs: false` were served — Python's `0 == False`
    let a number pass for a boolean (and `true` for `1`)."""
    answer = post(fuzz_api, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1, field: value})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == field


@pytest.mark.parametrize("role", [{}, [], 3])
def test_a_chat_role_that_is_not_a_string_is_a_400(fuzz_api: RunningApi, role: Any) -> None:
    """Schemathesis: `role: {}` was a 500 (TypeError: a dict is unhashable, `in ROLES`)."""
    answer = post(fuzz_api, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": role, "content": "hi"}]})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "messages[0].role"


def test_a_number_without_a_fraction_is_an_integer(fuzz_api: RunningApi) -> None:
    """Schemathesis: `max_completion_tokens: 2.0` and `prompt: [7769.0, 31990]` were 400s; JSON
    (and JSON Schema's `integer`) does not tell 2.0 from 2. 2.5 stays a 400."""
    ids = fuzz_api.engine.tokenizer.encode("Hello there")
    answer = post(fuzz_api, "/v1/completions", {"model": MODEL, "prompt": [float(i) for i in ids],
                                                "max_tokens": 2.0, "ignore_eos": True})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"] == {**answer.json()["usage"], "prompt_tokens": len(ids), "completion_tokens": 2}
    chat = post(fuzz_api, "/v1/chat/completions", {"model": MODEL, "messages": USER, "max_completion_tokens": 1.0})
    assert chat.status_code == 200, chat.text
    bad = post(fuzz_api, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2.5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_a_request_id_is_printable_ascii(fuzz_api: RunningApi) -> None:
    """The schema states the id rule as a pattern; `str.isprintable` (any script, and a Unicode
    version's idea of unassigned) cannot be one, so the rule became printable ASCII."""
    answer = post(fuzz_api, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                                "request_id": "café"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "request_id"
    ok = post(fuzz_api, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                            "request_id": "fuzz-id ~1"})
    assert ok.status_code == 200, ok.text


def test_list_models_refuses_a_request_that_does_not_decode(fuzz_api: RunningApi) -> None:
    """gRPC fuzzer: ListModels answered OK to the bytes `b"\\x00"` (not a ListModelsRequest) —
    the other RPCs said INVALID_ARGUMENT; garbage is no request, even for an empty message."""
    with grpc.insecure_channel(fuzz_api.grpc_target) as channel:
        call = channel.unary_unary("/halfmoon.v1.Generation/ListModels", request_serializer=None,
                                   response_deserializer=pb.ListModelsResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            call(b"\x00", metadata=[("authorization", AUTH["Authorization"])], timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(call(b"", metadata=[("authorization", AUTH["Authorization"])], timeout=30).models) == 1


def test_a_top_k_over_int64_is_served_and_the_engine_lives(fuzz_api: RunningApi) -> None:
    """Schemathesis: `top_k: 57553893800891459305472` failed the engine's step ("Overflow when
    unpacking long long"), which stopped the engine: every later request was a 503 and /health
    said unavailable. A k at or over the vocabulary now means every token."""
    answer = post(fuzz_api, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                "temperature": 1.0, "top_k": 57553893800891459305472})
    assert answer.status_code == 200, answer.text
    health = httpx.get(f"{fuzz_api.http_url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_a_prompt_the_vocabulary_cannot_spell_is_a_400_the_schema_foretells(fuzz_api: RunningApi) -> None:
    """Schemathesis: the schema-valid prompt "\\x14" was a 400 "is empty": SmolLM2's vocabulary
    has no token for it. The document now says which characters the tokenizer drops."""
    answer = post(fuzz_api, "/v1/completions", {"model": MODEL, "prompt": "\x14\x04", "max_tokens": 1})
    assert answer.status_code == 400 and "vocabulary" in answer.json()["error"]["message"]
    doc = httpx.get(f"{fuzz_api.http_url}/openapi.json", timeout=10).json()
    text = doc["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"][0]
    assert text["pattern"] == r"[^\x04\x06\x13\x14\x16\x1d]"
    assert post(fuzz_api, "/v1/completions", {"model": MODEL, "prompt": "\x14a", "max_tokens": 1}).status_code == 200
