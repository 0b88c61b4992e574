"""The OpenAI-compatible HTTP front door with the official `openai` client, plus metrics, auth,
TLS, limits and disconnects."""

from __future__ import annotations

import json
import ssl
import subprocess
import threading
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from halfmoon.api.requests import Limits
from halfmoon.engine.engine import Engine
from halfmoon.core.params import SamplingParams
from halfmoon.v1 import generation_pb2 as pb
from halfmoon.v1 import generation_pb2_grpc as pb_grpc
from tests.conductor.conftest import MODEL, RunningApi

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def oai(api: RunningApi, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.http_url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0,
                         **kw)


def greedy(engine: Engine, ids: list[int], n: int) -> str:
    """The reference: a second engine on the same weights (never the server's own)."""
    return engine.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))[0].text


def chat_ids(api: RunningApi) -> list[int]:
    tok = api.engine.tokenizer
    return tok.encode(tok.apply_chat_template(MESSAGES))


def test_chat_streaming_and_not_equal_the_engine(api: RunningApi, engine: Engine) -> None:
    want = greedy(engine, chat_ids(api), 12)
    client = oai(api)
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                          extra_body={"ignore_eos": True})
    assert full.choices[0].message.content == want and full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(chat_ids(api)), 12)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completions_text_and_token_ids(api: RunningApi, engine: Engine) -> None:
    ids = api.engine.tokenizer.encode(PROMPT)
    want = greedy(engine, ids, 8)
    client = oai(api)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True})
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, extra_body={"ignore_eos": True})
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stream=True,
                                         extra_body={"ignore_eos": True})
    assert by_text.choices[0].text == by_ids.choices[0].text == want
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want
    assert by_text.usage.total_tokens == len(ids) + 8


def test_models_health_and_defaults(api: RunningApi) -> None:
    client = oai(api)
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(api.http_url + "/health").json() == {"status": "ok"}
    out = client.completions.create(model=MODEL, prompt=PROMPT)  # OpenAI's default: 16 tokens
    assert out.usage.completion_tokens <= 16


def test_metrics_parse_and_follow_prometheus_conventions(api: RunningApi) -> None:
    oai(api).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError):
        oai(api).completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    text = httpx.get(api.http_url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert all(name.startswith("halfmoon_") for name in families)
    for f in families.values():
        if f.type == "counter":
            assert all(s.name.endswith("_total") for s in f.samples), f.name
        if f.type == "histogram":
            assert f.name.endswith("_seconds"), f.name
    assert families["halfmoon_time_to_first_token_seconds"].type == "histogram"
    assert families["halfmoon_time_per_output_token_seconds"].type == "histogram"
    counts = {(s.labels["api"], s.labels["code"]): s.value for s in families["halfmoon_requests"].samples}
    assert counts[("http", "ok")] >= 1 and counts[("http", "invalid_argument")] >= 1
    assert families["halfmoon_kv_cache_blocks"].samples[0].value == api.engine.pool.num_blocks
    assert not any(s.name.endswith("_created") for f in families.values() for s in f.samples)


def test_stream_disconnect_frees_the_kv(api: RunningApi) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", api.http_url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"]
    assert api.wait_idle() == []


def test_non_streaming_disconnect_frees_the_kv(api: RunningApi) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(api.http_url + "/v1/completions", json=body, timeout=0.5)
    assert api.wait_idle() == []


def test_slo_rejection_is_429_with_predictions(api: RunningApi) -> None:
    oai(api).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, extra_body={"ignore_eos": True})
    r = httpx.post(api.http_url + "/v1/completions",
                   json={"model": MODEL, "prompt": PROMPT, "slo": {"ttft_ms": 0.001}})
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and "predicted TTFT" in err["message"]
    assert err["reason"] == "ttft" and err["retry_after_s"] > 0
    assert err["prediction"]["predicted_ttft_ms"] > err["prediction"]["ttft_slo_ms"] == 0.001


def test_per_client_stream_limit(start_api) -> None:
    small = start_api(limits=Limits(max_streams_per_client=1))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", small.http_url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()  # kept referenced: closing this generator closes the connection
        assert next(lines).startswith("data: ")
        second = httpx.post(small.http_url + "/v1/completions", json={**body, "stream": False})
        with grpc.insecure_channel(small.grpc_target) as channel, pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(prompt=PROMPT)))
    assert second.status_code == 429 and "requests in flight" in second.json()["error"]["message"]
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert small.wait_idle() == []
    after = httpx.post(small.http_url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2})
    assert after.status_code == 200  # the slot came back


def test_bearer_token_auth_on_both_apis(start_api, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# API tokens\nsecret-one\nsecret-two\n")
    guarded = start_api(api_token_file=str(tokens))
    with pytest.raises(openai.AuthenticationError):
        oai(guarded, api_key="wrong").models.list()
    assert [m.id for m in oai(guarded, api_key="secret-two").models.list().data] == [MODEL]
    assert httpx.get(guarded.http_url + "/health").status_code == 200  # probes need no token
    assert httpx.get(guarded.http_url + "/metrics").status_code == 200
    with grpc.insecure_channel(guarded.grpc_target) as channel:
        s = pb_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            s.ListModels(pb.ListModelsRequest())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        models = s.ListModels(pb.ListModelsRequest(), metadata=[("authorization", "Bearer secret-one")])
        assert models.models[0].id == MODEL


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


def test_tls_on_both_apis(start_api, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    secure = start_api(tls_cert=str(cert), tls_key=str(key))
    assert secure.http_url.startswith("https://")
    client = oai(secure, http_client=httpx.Client(verify=ssl.create_default_context(cafile=str(cert))))
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert out.usage.completion_tokens == 2
    with pytest.raises(httpx.TransportError):  # plain HTTP is not served on the TLS port
        httpx.get(secure.http_url.replace("https", "http") + "/health")
    creds = grpc.ssl_channel_credentials(cert.read_bytes())
    with grpc.secure_channel(secure.grpc_target, creds) as channel:
        assert pb_grpc.GenerationStub(channel).ListModels(pb.ListModelsRequest()).models[0].id == MODEL


def test_many_concurrent_openai_streams(api: RunningApi, engine: Engine) -> None:
    want = greedy(engine, api.engine.tokenizer.encode(PROMPT), 6)
    results: list[str] = []

    def one() -> None:
        chunks = oai(api).completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, stream=True,
                                             extra_body={"ignore_eos": True})
        results.append("".join(c.choices[0].text for c in chunks if c.choices))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [want] * 8


def test_tokens_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from halfmoon.api.auth import TOKENS_ENV, Authenticator, load_tokens
    from halfmoon.conductor.errors import UnauthenticatedError
    from halfmoon.core.errors import ConfigError

    monkeypatch.setenv(TOKENS_ENV, "alpha, beta")
    auth = Authenticator(load_tokens(None))
    assert auth.enabled and auth.check("Bearer beta") == auth.check("bearer beta")
    assert auth.check("Bearer alpha") != auth.check("Bearer beta")  # distinct client identities
    with pytest.raises(UnauthenticatedError):
        auth.check("Bearer gamma")
    monkeypatch.delenv(TOKENS_ENV)
    assert not Authenticator(load_tokens(None)).enabled
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ConfigError, match="holds no token"):
        load_tokens(str(empty))
