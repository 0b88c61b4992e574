"""The Python SDK (`halfmoon.client`) and `halfmoon client`, against real servers over the real model.

The reference outputs come from the session's stand-alone engine (`shared_engine`), not from
`api.engine`: the server's engine thread steps that engine whenever it has work, so driving it
from the test thread too would race with it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from halfmoon.api.requests import Limits
from halfmoon.engine.engine import Engine
from halfmoon.engine.outputs import CompletionResult
from halfmoon.core.params import SamplingParams
from halfmoon.client import (TOKEN_ENV, APIError, AsyncClient, Client, DeadlineExceededError,
                             GenerationResult, InvalidArgumentError, ModelInfo, NotFoundError,
                             PermissionDeniedError, ResourceExhaustedError, RetryEvent, RetryPolicy, StreamChunk,
                             UnauthenticatedError, UnavailableError, api_error)
from tests.conductor.conftest import RunningApi
from tests.conftest import assert_engine_idle
from tests.waiting import poll

# The real-server fixtures (module-scoped by their conftest's location, so bound here; assigned
# rather than imported so the tests' `api` parameters do not read as redefinitions).

PROMPT = "The capital of France is"
MAX_TOKENS = 12
CLI = [sys.executable, "-m", "halfmoon.cli.main", "client"]
ENV = {k: v for k, v in os.environ.items() if k != TOKEN_ENV} | {"PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def reference(shared_engine: Engine) -> CompletionResult:
    """PROMPT, greedy, MAX_TOKENS tokens, straight from an engine."""
    ids = shared_engine.tokenizer.encode(PROMPT)
    result = shared_engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    assert_engine_idle(shared_engine)
    return result


@pytest.fixture(autouse=True)
def no_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def closed_port() -> int:
    """A port nothing listens on (bound once, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proxy:
    """A TCP relay to a server that counts connections, can refuse (close) its first `refuse`
    ones, and can drop every relayed connection at once (a network failure mid-call)."""

    def __init__(self, target: str, refuse: int = 0) -> None:
        host, port = target.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.refuse = refuse
        self.accepted = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            if self.accepted <= self.refuse:
                conn.close()
                continue
            upstream = socket.create_connection(self.upstream)
            with self._lock:
                self._sockets += [conn, upstream]
            for src, dst in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            _shut(s)

    def drop(self) -> None:
        with self._lock:
            for s in self._sockets:
                _shut(s)

    def close(self) -> None:
        self.listener.close()
        self.drop()


def _shut(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def eventually(check: Callable[[], object], timeout: float = 5.0) -> object:
    """`check()` once it stops raising (for effects the server finishes just after replying)."""

    def attempt() -> tuple[object] | None:
        try:
            return (check(),)
        except (APIError, AssertionError):
            return None

    done = poll(attempt, timeout)
    return done[0] if done else check()  # the last try raises its error for the report


# ---------------------------------------------------------------------------------- basics

def test_import_halfmoon_stays_cheap_and_exposes_the_client() -> None:
    code = ("import sys, halfmoon; assert 'grpc' not in sys.modules, 'grpc imported'; "
            "import halfmoon.client as c; "
            "assert (halfmoon.Client, halfmoon.AsyncClient, halfmoon.APIError) == "
            "(c.Client, c.AsyncClient, c.APIError); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    with pytest.raises(AttributeError):
        import halfmoon

        halfmoon.NoSuchThing  # noqa: B018


def test_generate_and_stream_give_the_engines_tokens(api: RunningApi, reference: CompletionResult) -> None:
    with Client(api.grpc_target) as client:
        result = client.generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
        chunks = list(client.stream(prompt_token_ids=reference.prompt_ids, max_tokens=MAX_TOKENS,
                                    ignore_eos=True))
    assert isinstance(result, GenerationResult)
    assert result.token_ids == reference.output_ids and result.text == reference.text
    assert result.finish_reason == "length" and result.stop is None and result.request_id
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(reference.prompt_ids), MAX_TOKENS)
    t = result.timings
    assert 0 < t.ttft_ms <= t.e2e_ms and t.mean_tpot_ms > 0 and t.queue_ms >= 0
    # Streamed as sampled: several chunks, only the last one carries the result.
    assert len(chunks) > 1 and all(isinstance(c, StreamChunk) for c in chunks)
    assert [c.result is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert [t for c in chunks for t in c.token_ids] == reference.output_ids
    assert "".join(c.text for c in chunks) == reference.text
    final = chunks[-1].result
    assert final is not None and final.token_ids == reference.output_ids and final.text == reference.text
    assert {c.request_id for c in chunks} == {final.request_id} and final.request_id != result.request_id


def test_async_client_gives_the_same(api: RunningApi, reference: CompletionResult) -> None:
    async def main() -> tuple[GenerationResult, list[StreamChunk], list[int], list[ModelInfo]]:
        async with AsyncClient(api.grpc_target) as client:
            result = await client.generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
            chunks = [c async for c in client.stream(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)]
            return result, chunks, await client.tokenize(PROMPT), await client.models()

    result, chunks, ids, models = asyncio.run(main())
    assert result.token_ids == reference.output_ids and result.text == reference.text
    assert result.finish_reason == "length"
    assert [t for c in chunks for t in c.token_ids] == reference.output_ids
    assert chunks[-1].result is not None and chunks[-1].result.text == reference.text
    assert ids == reference.prompt_ids
    assert [m.id for m in models] == ["smollm2"]


def test_async_client_maps_errors(api: RunningApi) -> None:
    async def main() -> tuple[APIError, APIError]:
        async with AsyncClient(api.grpc_target) as client:
            with pytest.raises(InvalidArgumentError) as bad:
                await client.generate(PROMPT, top_p=0.0)
            with pytest.raises(NotFoundError) as missing:
                async for _ in client.stream(PROMPT, model="nope"):
                    pass
            return bad.value, missing.value

    bad, missing = asyncio.run(main())
    assert bad.field == "sampling.top_p" and missing.field == "model"


def test_tokenize_and_models(api: RunningApi) -> None:
    tok = api.engine.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    with Client(api.grpc_target) as client:
        assert client.tokenize(PROMPT) == tok.encode(PROMPT)
        chat_ids = client.tokenize(messages=messages)
        assert chat_ids == tok.encode(tok.apply_chat_template(messages))
        result = client.generate(messages=messages, max_tokens=2, ignore_eos=True)
        models = client.models()
    assert result.usage.prompt_tokens == len(chat_ids) and len(result.token_ids) == 2
    assert models == [ModelInfo("smollm2", api.engine.max_model_len, api.engine.model_config.vocab_size,
                                "halfmoon", "llama", "float32")]


# ---------------------------------------------------------------------------------- errors

def test_invalid_argument_names_the_field(api: RunningApi) -> None:
    with Client(api.grpc_target) as client:
        with pytest.raises(InvalidArgumentError) as top_p:
            client.generate(PROMPT, top_p=0.0)
        with pytest.raises(InvalidArgumentError) as nothing:
            next(client.stream(max_tokens=2))
        with pytest.raises(InvalidArgumentError) as both:
            client.tokenize()
    e = top_p.value
    assert e.code is grpc.StatusCode.INVALID_ARGUMENT and e.field == "sampling.top_p"
    assert "(0, 1]" in e.message and e.retry_after_s is None and e.prediction is None
    assert str(e).startswith("INVALID_ARGUMENT: sampling.top_p")
    assert nothing.value.field == "prompt" and "exactly one" in nothing.value.message
    assert both.value.field == "text"


def test_unknown_model_is_not_found(api: RunningApi) -> None:
    with Client(api.grpc_target) as client:
        with pytest.raises(NotFoundError) as e:
            client.generate(PROMPT, model="nope", max_tokens=2)
        with pytest.raises(NotFoundError):
            client.tokenize(PROMPT, model="nope")
    assert e.value.code is grpc.StatusCode.NOT_FOUND and e.value.field == "model"
    assert "'nope'" in e.value.message and "smollm2" in e.value.message


def test_predicted_slo_miss_is_resource_exhausted_with_the_prediction(api: RunningApi) -> None:
    with Client(api.grpc_target) as client:
        client.generate("Warm up the load predictor:", max_tokens=2)
        with pytest.raises(ResourceExhaustedError) as e:
            client.generate(PROMPT, max_tokens=2, ttft_slo_ms=0.001)
    err = e.value
    assert err.reason == "ttft" and err.rejected and err.retry_after_s is not None and err.retry_after_s > 0
    assert err.prediction is not None and err.prediction.ttft_slo_ms == pytest.approx(0.001)
    assert err.prediction.predicted_ttft_ms > 0.001
    assert "SLO" in err.message


def test_auth_needs_the_right_token(start_api: Callable[..., RunningApi], tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = tmp_path / "server-tokens"
    tokens.write_text("# tokens\nsecret-one\nsecret-two\n")
    srv = start_api(api_token_file=str(tokens), num_blocks=16)
    for kwargs in ({}, {"token": "wrong"}):
        with Client(srv.grpc_target, **kwargs) as client:
            for call in (client.models, lambda: client.generate(PROMPT, max_tokens=1),
                         lambda: client.tokenize(PROMPT)):
                with pytest.raises(UnauthenticatedError) as e:
                    call()
                assert e.value.code is grpc.StatusCode.UNAUTHENTICATED
    mine = tmp_path / "my-token"
    mine.write_text("\n# mine\n  secret-two  \n")
    monkeypatch.setenv(TOKEN_ENV, "secret-one")
    for kwargs in ({"token": "secret-one"}, {"token_file": mine}, {}):  # {} = from the environment
        with Client(srv.grpc_target, **kwargs) as client:
            assert [m.id for m in client.models()] == ["smollm2"]
            assert len(client.generate(PROMPT, max_tokens=2, ignore_eos=True).token_ids) == 2
    assert srv.wait_idle() == []


def test_tls_with_the_servers_certificate(start_api: Callable[..., RunningApi], tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    srv = start_api(tls_cert=str(cert), tls_key=str(key), num_blocks=16)
    with Client(srv.grpc_target, tls=True, root_certificates=cert.read_bytes()) as client:
        assert [m.id for m in client.models()] == ["smollm2"]
        assert client.generate(PROMPT, max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
    with Client(srv.grpc_target, max_retries=0) as plaintext, pytest.raises(UnavailableError):
        plaintext.models()
    with Client(srv.grpc_target, tls=True, max_retries=0) as untrusted, pytest.raises(UnavailableError):
        untrusted.models()  # the system CAs do not vouch for a self-signed certificate
    assert srv.wait_idle() == []


def test_too_many_streams_is_resource_exhausted_with_retry_after(start_api: Callable[..., RunningApi]) -> None:
    srv = start_api(limits=Limits(max_streams_per_client=1), num_blocks=16)
    retries: list[RetryEvent] = []
    with Client(srv.grpc_target, on_retry=retries.append) as client:
        stream = client.stream(PROMPT, max_tokens=16, ignore_eos=True)
        first = next(stream)  # the stream now holds this client's only slot
        assert first.token_ids
        with pytest.raises(ResourceExhaustedError) as e:
            client.generate(PROMPT, max_tokens=1)
        stream.close()  # cancels the call: the server aborts it and frees the slot
        assert srv.wait_idle() == []
        again = eventually(lambda: client.generate(PROMPT, max_tokens=1))
    err = e.value
    assert err.code is grpc.StatusCode.RESOURCE_EXHAUSTED and err.retry_after_s == pytest.approx(1.0)
    assert err.reason == "too_many_streams" and "limit 1" in err.message and err.prediction is None
    assert retries == []  # only UNAVAILABLE is retried
    assert isinstance(again, GenerationResult) and len(again.token_ids) == 1


def test_error_class_per_status() -> None:
    for code, cls in [(grpc.StatusCode.INVALID_ARGUMENT, InvalidArgumentError),
                      (grpc.StatusCode.UNAVAILABLE, UnavailableError),
                      (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceededError),
                      (grpc.StatusCode.PERMISSION_DENIED, PermissionDeniedError)]:
        assert type(api_error(code, "m")) is cls
    other = api_error(grpc.StatusCode.DATA_LOSS, "m")  # a status the server never sends
    assert type(other) is APIError and other.code is grpc.StatusCode.DATA_LOSS


# ---------------------------------------------------------------------------------- deadlines

def test_deadline_stops_the_work(api: RunningApi) -> None:
    with Client(api.grpc_target) as client:
        with pytest.raises(DeadlineExceededError) as e:
            client.generate(PROMPT, max_tokens=16, ignore_eos=True, timeout=0.2)
        assert e.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert api.wait_idle() == []
    with Client(api.grpc_target, timeout=0.2) as client:  # the client's default deadline
        with pytest.raises(DeadlineExceededError):
            list(client.stream(PROMPT, max_tokens=16, ignore_eos=True))
        assert api.wait_idle() == []
        assert client.tokenize(PROMPT)  # a quick call fits in the same default


# ---------------------------------------------------------------------------------- retries

def test_retry_policy_retries_unavailable_only_and_never_after_a_chunk() -> None:
    policy = RetryPolicy(max_retries=2, backoff_s=0.1, max_backoff_s=0.3)
    down = UnavailableError(grpc.StatusCode.UNAVAILABLE, "down")
    assert policy.should_retry(down, retries=0, received=0)
    assert policy.should_retry(down, retries=1, received=0)
    assert not policy.should_retry(down, retries=2, received=0)  # max_retries reached
    assert not policy.should_retry(down, retries=0, received=1)  # tokens were delivered
    for code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
                 grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED):
        assert not policy.should_retry(api_error(code, "x"), retries=0, received=0)
    rng = random.Random(0)
    for retries, base in [(0, 0.1), (1, 0.2), (2, 0.3), (5, 0.3)]:  # doubling, capped at 0.3
        delays = [policy.delay_s(retries, rng) for _ in range(200)]
        assert base * 0.5 <= min(delays) < max(delays) <= base * 1.5  # jittered


CALLS: dict[str, Callable[[Client], object]] = {
    "models": lambda c: c.models(), "tokenize": lambda c: c.tokenize("hi"),
    "generate": lambda c: c.generate("hi"), "stream": lambda c: list(c.stream("hi")),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_unreachable_server_is_retried_then_unavailable(call: str) -> None:
    target = f"127.0.0.1:{closed_port()}"
    events: list[RetryEvent] = []
    client = Client(target, max_retries=3, backoff_s=0.01, on_retry=events.append)
    with client, pytest.raises(UnavailableError) as e:
        CALLS[call](client)
    assert e.value.code is grpc.StatusCode.UNAVAILABLE
    assert [ev.retry for ev in events] == [1, 2, 3]  # 4 attempts
    assert all(isinstance(ev.error, UnavailableError) for ev in events)
    assert all(0.005 * 2**n <= ev.delay_s <= 0.015 * 2**n for n, ev in enumerate(events))  # backoff
    events.clear()
    with Client(target, max_retries=0, on_retry=events.append) as once, pytest.raises(UnavailableError):
        CALLS[call](once)
    assert events == []


def test_a_retry_after_a_refused_connection_succeeds(api: RunningApi) -> None:
    proxy = Proxy(api.grpc_target, refuse=1)
    events: list[RetryEvent] = []
    try:
        with Client(proxy.target, max_retries=5, backoff_s=0.05, on_retry=events.append) as client:
            result = client.generate(PROMPT, max_tokens=2, ignore_eos=True)
    finally:
        proxy.close()
    assert len(result.token_ids) == 2
    assert events and all(isinstance(ev.error, UnavailableError) for ev in events)
    assert proxy.accepted >= 2


def test_a_stream_is_not_retried_after_its_first_chunk(api: RunningApi) -> None:
    proxy = Proxy(api.grpc_target)
    events: list[RetryEvent] = []
    chunks: list[StreamChunk] = []
    try:
        client = Client(proxy.target, max_retries=3, backoff_s=0.01, on_retry=events.append)
        with client, pytest.raises(UnavailableError):
            for chunk in client.stream(PROMPT, max_tokens=16, ignore_eos=True):
                chunks.append(chunk)
                proxy.drop()  # the connection dies mid-stream
    finally:
        proxy.close()
    assert chunks and all(c.result is None for c in chunks)  # 1, or 2 if one was in flight
    assert events == [] and proxy.accepted == 1  # never sent again
    assert api.wait_idle() == []  # the server noticed the disconnect and aborted the request


# ---------------------------------------------------------------------------------- CLI

def test_cli_generate_json_and_streamed_text_match_the_engine(api: RunningApi,
                                                               reference: CompletionResult) -> None:
    proc = run_cli("generate", PROMPT, "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json",
                   "--target", api.grpc_target)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == reference.output_ids and out["text"] == reference.text
    assert out["finish_reason"] == "length" and out["usage"]["completion_tokens"] == MAX_TOKENS
    assert out["timings"]["ttft_ms"] > 0 and out["request_id"]
    ids = ",".join(map(str, reference.prompt_ids))
    proc = run_cli("generate", "--prompt-ids", ids, "--max-tokens", str(MAX_TOKENS), "--ignore-eos",
                   "--target", api.grpc_target)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == reference.text + "\n"
    assert f"[length: {MAX_TOKENS} tokens, TTFT" in proc.stderr and "TPOT" in proc.stderr


def test_cli_models_and_tokenize(api: RunningApi) -> None:
    proc = run_cli("models", "--target", api.grpc_target)
    assert proc.returncode == 0, proc.stderr
    header, row = proc.stdout.splitlines()
    assert header.split() == ["ID", "MAX_MODEL_LEN", "VOCAB_SIZE", "OWNED_BY", "PARENT"]
    assert row.split() == ["smollm2", str(api.engine.max_model_len), str(api.engine.model_config.vocab_size),
                           "halfmoon", "-"]
    proc = run_cli("tokenize", PROMPT, "--target", api.grpc_target)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ",".join(map(str, api.engine.tokenizer.encode(PROMPT)))


@pytest.mark.parametrize("args,needles", [
    (["generate", "hi", "--top-p", "0"], ["INVALID_ARGUMENT: sampling.top_p: must be in (0, 1]"]),
    (["chat", "hi", "--model", "nope"], ["NOT_FOUND: model 'nope'", "(field: model)"]),
    (["models", "--token-file", "/no/such/file"], ["cannot read the API token file"]),
])
def test_cli_errors_exit_2_without_a_traceback(api: RunningApi, args: list[str], needles: list[str]) -> None:
    proc = run_cli(*args, "--target", api.grpc_target)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("halfmoon: error: ") and "Traceback" not in proc.stderr
    assert all(n in proc.stderr for n in needles), proc.stderr


def test_cli_unreachable_server_exits_3() -> None:
    proc = run_cli("models", "--target", f"127.0.0.1:{closed_port()}")
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("halfmoon: error: UNAVAILABLE: ") and "Traceback" not in proc.stderr
