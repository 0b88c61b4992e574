"""`halfmoon serve` as users run it (a real process), called by clients nobody here wrote: the
official `openai` package and a generic gRPC reflection client. Greedy output through either
API equals `halfmoon generate` for the same prompt (both in the token-exact mode, fp32 unquantized:
serve's default precision is bf16, whose batched steps may round differently)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from halfmoon.conductor.serve_defaults import EXACT_FLAGS
from tests.e2e.support import wait_for_log

CLI = [sys.executable, "-m", "halfmoon.cli.main"]
EXACT = list(EXACT_FLAGS)  # --dtype float32 --quantization none
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"
N = 12


class Served:
    def __init__(self, proc: subprocess.Popen[str], log: Path, grpc_target: str, http_url: str) -> None:
        self.proc, self.log, self.grpc_target, self.http_url = proc, log, grpc_target, http_url

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.http_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*CLI, "serve", "--colocated", "--grpc-port", "0", "--http-port", "0", "--threads", "1",
                                 "--no-redis", *EXACT], stdout=out, stderr=out, text=True, env=ENV)
    try:
        match = wait_for_log(proc, log, r"listening grpc=(\S+) http=(\S+)")
        yield Served(proc, log, match.group(1), match.group(2))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def halfmoon_generate(*args: str) -> dict:
    proc = subprocess.run([*CLI, "generate", *args, "--max-tokens", str(N), "--ignore-eos", "--json",
                           "--threads", "1", *EXACT], capture_output=True, text=True, timeout=180, env=ENV)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def reference() -> dict[str, dict]:
    """What `halfmoon generate` prints for the plain prompt and for the chat question."""
    return {"prompt": halfmoon_generate("--prompt", PROMPT),
            "chat": halfmoon_generate("--prompt", QUESTION, "--chat")}


def test_openai_completions_equal_halfmoon_generate(served: Served, reference: dict[str, dict]) -> None:
    client = served.openai()
    full = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=N, extra_body={"ignore_eos": True})
    chunks = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=N, stream=True,
                                       extra_body={"ignore_eos": True})
    assert full.choices[0].text == reference["prompt"]["text"]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference["prompt"]["text"]
    assert full.usage.prompt_tokens == len(reference["prompt"]["prompt_ids"])


def test_openai_chat_equals_halfmoon_generate_chat(served: Served, reference: dict[str, dict]) -> None:
    client = served.openai()
    messages = [{"role": "user", "content": QUESTION}]
    full = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=N,
                                          extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model="smollm2", messages=messages, max_tokens=N, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert full.choices[0].message.content == reference["chat"]["text"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference["chat"]["text"]
    assert chunks[-1].usage.completion_tokens == N
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_reflection_client_without_stubs_equals_halfmoon_generate(served: Served,
                                                                  reference: dict[str, dict]) -> None:
    with grpc.insecure_channel(served.grpc_target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"halfmoon.v1.Generation", "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection"} <= services
        pool = descriptor_pool.DescriptorPool(db)
        method = pool.FindServiceByName("halfmoon.v1.Generation").methods_by_name["Generate"]
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        generate = channel.unary_stream("/halfmoon.v1.Generation/Generate",
                                        request_serializer=request_cls.SerializeToString,
                                        response_deserializer=response_cls.FromString)
        responses = list(generate(request_cls(prompt=PROMPT, max_tokens=N, ignore_eos=True), timeout=60))
    assert [t for r in responses for t in r.token_ids] == reference["prompt"]["output_ids"]
    assert "".join(r.text for r in responses) == reference["prompt"]["text"]
    assert responses[-1].final.usage.completion_tokens == N


def test_metrics_and_health_over_http(served: Served) -> None:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    assert httpx.get(served.http_url + "/health").json() == {"status": "ok"}
    names = {f.name for f in text_string_to_metric_families(httpx.get(served.http_url + "/metrics").text)}
    assert {"halfmoon_requests", "halfmoon_time_to_first_token_seconds", "halfmoon_kv_cache_usage_ratio",
            "halfmoon_requests_rerun"} <= names
