"""The front door's half of admission, through both APIs on a real server (over a scripted
backend: the test says what admission decided): the priority class a request names, requests
whose KV can never fit, rejections as clean 429 / RESOURCE_EXHAUSTED answers with a reason, a
Retry-After and the predictions, and an admitted request's prediction on its last message."""

from __future__ import annotations

import json
import math
from typing import Any

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from halfmoon.conductor.errors import (OverloadedError, RetryableRejection, SloMissError, TooManyStreamsError,
                              status_of)
from halfmoon.conductor.router import NoDecodeCapacityError
from halfmoon.core.messages import SloPrediction
from halfmoon.v1 import generation_pb2 as pb
from halfmoon.v1 import generation_pb2_grpc as pb_grpc
from tests.conductor.conftest import MODEL, SCRIPTED_KV_TOKENS, RunningApi

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
PREDICTION = SloPrediction(predicted_ttft_ms=3100.0, predicted_tbt_ms=40.5, ttft_slo_ms=2000.0, tbt_slo_ms=150.0)


def generate(api: RunningApi, **fields: Any) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(api.grpc_target) as channel:
        return list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(**fields), timeout=30))


def grpc_call(api: RunningApi, **fields: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        generate(api, **fields)
    return err.value


def rpc_details(error: grpc.RpcError) -> dict[str, Any]:
    """The google.rpc details of an error, by type name."""
    status = rpc_status.from_call(error)
    assert status is not None, "no grpc-status-details-bin trailer"
    out: dict[str, Any] = {}
    for d in status.details:
        for cls in (error_details_pb2.BadRequest, error_details_pb2.RetryInfo, error_details_pb2.ErrorInfo,
                    pb.SloPrediction):
            if d.Is(cls.DESCRIPTOR):
                out[cls.DESCRIPTOR.name] = cls()
                d.Unpack(out[cls.DESCRIPTOR.name])
    return out


def grpc_field(error: grpc.RpcError) -> str:
    return rpc_details(error)["BadRequest"].field_violations[0].field


def http_call(api: RunningApi, path: str, payload: dict[str, Any],
              headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(api.http_url + path, json=payload, headers=headers or {}, timeout=30)


def sse(api: RunningApi, path: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", api.http_url + path, json={**payload, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---------------------------------------------------------------------------------- priority class

def test_the_priority_class_reaches_the_backend_from_each_api(scripted: RunningApi) -> None:
    backend = scripted.backend
    generate(scripted, prompt="hi", max_tokens=2, priority_class="interactive")
    generate(scripted, prompt="hi", max_tokens=2)  # empty = the server's default
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert http_call(scripted, COMPLETIONS, {**body, "priority_class": "batch"}).status_code == 200
    assert http_call(scripted, COMPLETIONS, body, {"X-Priority-Class": "interactive"}).status_code == 200
    both = http_call(scripted, COMPLETIONS, {**body, "priority_class": "standard"}, {"X-Priority-Class": "batch"})
    assert both.status_code == 200  # the body wins
    assert [i.priority_class for i in backend.inputs] == ["interactive", None, "batch", "interactive", "standard"]


def test_class_slos_stay_overridable_per_request(scripted: RunningApi) -> None:
    generate(scripted, prompt="hi", max_tokens=2, priority_class="batch", slo=pb.Slo(ttft_ms=500))
    (inp,) = scripted.backend.inputs
    assert (inp.priority_class, inp.slo.ttft_ms, inp.slo.tbt_ms) == ("batch", 500.0, None)


@pytest.mark.parametrize("how", ["grpc", "body", "header", "chat body"])
def test_an_unknown_priority_class_is_invalid_naming_its_field(scripted: RunningApi, how: str) -> None:
    if how == "grpc":
        err = grpc_call(scripted, prompt="hi", priority_class="vip")
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and grpc_field(err) == "priority_class"
        message = err.details()
    else:
        path, payload = ((CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}) if how == "chat body"
                         else (COMPLETIONS, {"model": MODEL, "prompt": "hi"}))
        headers = {"X-Priority-Class": "vip"} if how == "header" else {}
        r = http_call(scripted, path, payload if how == "header" else {**payload, "priority_class": "vip"}, headers)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == ("X-Priority-Class" if how == "header" else "priority_class")
        message = error["message"]
    assert "'vip' is not a priority class" in message and "interactive" in message
    assert scripted.backend.inputs == []  # refused at the front door


def test_a_priority_class_of_the_wrong_type_is_a_400(scripted: RunningApi) -> None:
    r = http_call(scripted, COMPLETIONS, {"model": MODEL, "prompt": "hi", "priority_class": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority_class"


# ---------------------------------------------------------------------------------- KV capacity

def test_a_request_that_can_never_fit_the_decode_kv_is_a_400_naming_max_tokens(scripted: RunningApi) -> None:
    ids = list(range(1, 41))  # 40 prompt tokens of a 64-token KV: at most 24 output tokens
    err = grpc_call(scripted, prompt_token_ids=ids, max_tokens=25)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and grpc_field(err) == "max_tokens"
    assert f"KV cache of {SCRIPTED_KV_TOKENS} tokens; at most 24" in err.details()
    r = http_call(scripted, COMPLETIONS, {"model": MODEL, "prompt": ids, "max_tokens": 25})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "at most 24" in r.json()["error"]["message"]
    assert generate(scripted, prompt_token_ids=ids, max_tokens=24)[-1].final.usage.completion_tokens == 1
    assert len(scripted.backend.inputs) == 1  # only the one that fits


def test_a_prompt_that_alone_fills_the_decode_kv_is_a_400_naming_the_prompt(scripted: RunningApi) -> None:
    ids = list(range(1, SCRIPTED_KV_TOKENS + 1))
    err = grpc_call(scripted, prompt_token_ids=ids, max_tokens=1)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and grpc_field(err) == "prompt_token_ids"
    assert "leave no room for output" in err.details()
    r = http_call(scripted, COMPLETIONS, {"model": MODEL, "prompt": ids, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


# ---------------------------------------------------------------------------------- rejections

REJECTIONS = {
    "ttft": (SloMissError(PREDICTION, 2.5, "ttft", "predicted TTFT 3100 ms > 2000 ms"), "ttft", "SloMissError"),
    "queue_full": (OverloadedError("9 requests are queued on the prefill worker (limit 8)", 0.2, "queue_full",
                                   PREDICTION), "queue_full", "OverloadedError"),
    "no reason, no prediction": (OverloadedError("busy", 1.0), "overloaded", "OverloadedError"),
}


@pytest.mark.parametrize("case", REJECTIONS)
def test_a_rejection_over_http_is_a_429_with_reason_retry_after_and_prediction(scripted: RunningApi,
                                                                               case: str) -> None:
    error, reason, _ = REJECTIONS[case]
    for stream in (False, True):  # a stream is admitted before it starts: a plain 429 too
        scripted.backend.rejections.append(error)
        r = http_call(scripted, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                       "stream": stream})
        assert r.status_code == 429, r.text
        assert r.headers["Retry-After"] == str(max(1, math.ceil(error.retry_after_s)))  # whole seconds
        body = r.json()["error"]
        assert (body["type"], body["code"], body["reason"]) == ("rate_limit_error", 429, reason)
        assert body["retry_after_s"] == pytest.approx(error.retry_after_s) and body["message"] == str(error)
        if error.prediction is None:
            assert "prediction" not in body
        else:
            assert body["prediction"] == {"predicted_ttft_ms": 3100.0, "predicted_tbt_ms": 40.5,
                                          "ttft_slo_ms": 2000.0, "tbt_slo_ms": 150.0}


@pytest.mark.parametrize("case", REJECTIONS)
def test_a_rejection_over_grpc_is_resource_exhausted_with_details(scripted: RunningApi, case: str) -> None:
    error, reason, kind = REJECTIONS[case]
    scripted.backend.rejections.append(error)
    err = grpc_call(scripted, prompt="hi")
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.details() == str(error)
    d = rpc_details(err)
    assert (d["ErrorInfo"].reason, d["ErrorInfo"].domain, d["ErrorInfo"].metadata["error"]) == (reason, "halfmoon",
                                                                                                kind)
    assert d["RetryInfo"].retry_delay.ToMilliseconds() == round(error.retry_after_s * 1e3)
    if error.prediction is None:
        assert "SloPrediction" not in d
    else:
        p = d["SloPrediction"]
        assert (p.predicted_ttft_ms, p.predicted_tbt_ms, p.ttft_slo_ms, p.tbt_slo_ms) == (3100.0, 40.5, 2000.0, 150.0)


def test_every_rejection_is_429_and_resource_exhausted_never_a_5xx() -> None:
    def subclasses(cls: type) -> set[type]:
        return {cls}.union(*(subclasses(c) for c in cls.__subclasses__()))

    kinds = subclasses(RetryableRejection)
    assert {TooManyStreamsError, OverloadedError, SloMissError, NoDecodeCapacityError} <= kinds
    for cls in kinds:
        status = status_of(cls.__new__(cls))
        assert (status.http, status.grpc) == (429, grpc.StatusCode.RESOURCE_EXHAUSTED), cls.__name__


# ---------------------------------------------------------------------------------- admitted

def test_an_admitted_requests_prediction_reaches_the_client(scripted: RunningApi) -> None:
    scripted.backend.prediction = SloPrediction(120.0, 30.5, 1000.0, 0.0)
    final = generate(scripted, prompt="hi", max_tokens=1)[-1].final
    assert final.HasField("prediction")
    assert (final.prediction.predicted_ttft_ms, final.prediction.predicted_tbt_ms) == (120.0, 30.5)
    assert (final.prediction.ttft_slo_ms, final.prediction.tbt_slo_ms) == (1000.0, 0.0)
    want = {"predicted_ttft_ms": 120.0, "predicted_tbt_ms": 30.5, "ttft_slo_ms": 1000.0, "tbt_slo_ms": 0.0}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    assert httpx.post(scripted.http_url + COMPLETIONS, json=body).json()["prediction"] == want
    chunks = sse(scripted, COMPLETIONS, {**body, "stream_options": {"include_usage": True}})
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["prediction"] for c in finish] == [want]
    assert all("prediction" not in c for c in chunks if c not in finish)


def test_no_prediction_no_field(scripted: RunningApi) -> None:
    assert not generate(scripted, prompt="hi", max_tokens=1)[-1].final.HasField("prediction")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert "prediction" not in httpx.post(scripted.http_url + CHAT, json=body).json()
    assert all("prediction" not in c for c in sse(scripted, CHAT, body))
