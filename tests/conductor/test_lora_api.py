"""LoRA adapters at the front door (api/admin.py): loaded, listed and unloaded over HTTP (vLLM's
endpoints), gRPC, the SDK and `halfmoon client adapters`, and from the start with `halfmoon serve
--lora NAME=PATH`; requests naming an adapter as their `model` get its tokens (equal to
transformers + peft on a tiny Llama checkpoint), unloaded ones a 404; adapters the base model
cannot serve are refused with their reason (400); the admin API needs an admin token (401) and is
closed on a server without one (403)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from halfmoon.api.server import ServerConfig
from halfmoon.client import (AsyncClient, Client, InvalidArgumentError, NotFoundError, PermissionDeniedError,
                             UnauthenticatedError)
from halfmoon.conductor.colocated import ColocatedBackend
from halfmoon.conductor.cost_model import CostModel
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.v1 import generation_pb2 as pb
from halfmoon.v1 import generation_pb2_grpc as pb_grpc
from tests.conductor.conftest import CLIENT_SLOS_ONLY, RunningApi, run_api
from tests.conftest import NUM_THREADS
from tests.e2e.support import cost_model_file
from tests.lora_support import make_adapter, peft_greedy
from tests.model_families import BY_NAME, build_checkpoint, prompts
from tests.waiting import poll

pytestmark = [pytest.mark.timeout(600)]
BASE = "tiny-llama"
NEW = 16
API_TOKEN, ADMIN_TOKEN = "api-token", "admin-token"
CLI = [sys.executable, "-m", "halfmoon.cli.main"]
ENV = {k: v for k, v in os.environ.items()
       if k not in ("HALFMOON_API_TOKEN", "HALFMOON_ADMIN_TOKEN", "HALFMOON_ADMIN_TOKENS", "HALFMOON_LORA")}


class Files:
    """The module's tiny Llama checkpoint, adapters of it (peft's own), and adapters it cannot
    serve. The checkpoint's folder name is its served name as adapters' base_model compares."""

    def __init__(self, root: Path) -> None:
        case = BY_NAME["llama"]
        self.cost = cost_model_file(root / "cost.json")  # fixed: the tiny model is not profiled
        self.base = root / "tiny-llama-ckpt"
        build_checkpoint(case, self.base)
        self.prompt = prompts(1)[0]
        self.good = root / "good"
        self.expected = peft_greedy(make_adapter(case, self.good, seed=11), self.prompt, NEW)
        self.second = root / "second"
        make_adapter(case, self.second, seed=12, rank=4, targets=("q_proj", "v_proj"))
        self.bad = {
            "missing folder": (root / "nowhere", "is not a folder"),
            "no safetensors": (_config_only(self.good, root / "config-only"), "no adapter_model.safetensors"),
            "rank over the maximum": (_adapter(case, root / "rank32", rank=32), "rank 32"),
            "another family's shapes": (_adapter(BY_NAME["qwen3"], root / "qwen3"), "do not fit the base model's"),
            "lm_head": (_adapter(case, root / "lm-head", targets=("lm_head",)), "['lm_head'] are not served"),
            "another base model": (_rebased(_adapter(case, root / "other-base"), "meta-llama/Llama-3.1-8B"),
                                   "it was trained on 'meta-llama/Llama-3.1-8B'"),
        }

    def engine(self, **overrides: Any) -> Engine:
        return Engine(EngineConfig(**{"model": str(self.base), "num_blocks": 64, "num_threads": NUM_THREADS,
                                      **overrides}))


def _adapter(case: Any, folder: Path, **kw: Any) -> Path:
    make_adapter(case, folder, seed=13, **kw)
    return folder


def _rebased(folder: Path, base: str) -> Path:
    """The adapter's config naming another base model (written after saving: peft looks a named
    base up on the Hub when it saves)."""
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": base}))
    return folder


def _config_only(source: Path, folder: Path) -> Path:
    folder.mkdir()
    shutil.copy(source / "adapter_config.json", folder)
    return folder


@pytest.fixture(autouse=True)
def no_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK's tokens come from the tests' arguments only."""
    for name in ("HALFMOON_API_TOKEN", "HALFMOON_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return Files(tmp_path_factory.mktemp("lora-api"))


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(API token file, admin token file)."""
    folder = tmp_path_factory.mktemp("lora-tokens")
    (folder / "api").write_text(API_TOKEN + "\n")
    (folder / "admin").write_text("# the admin API's\n" + ADMIN_TOKEN + "\n")
    return folder / "api", folder / "admin"


@pytest.fixture(scope="module")
def served(files: Files, tokens: tuple[Path, Path]) -> Iterator[RunningApi]:
    """A front door over a co-located engine of the tiny checkpoint, API and admin tokens on."""
    engine = files.engine()
    backend = ColocatedBackend(engine, BASE, admission=CLIENT_SLOS_ONLY, cost_model=CostModel.load(files.cost))
    running = run_api(backend, ServerConfig(grpc_port=0, http_port=0, api_token_file=str(tokens[0]),
                                            admin_token_file=str(tokens[1])))
    yield running
    running.stop()
    engine.close()


@pytest.fixture
def api(served: RunningApi) -> Iterator[RunningApi]:
    """The module's server with no adapter loaded, before and after."""
    assert served.backend.adapters is not None and served.backend.adapters.names() == []
    yield served
    for name in served.backend.adapters.names():
        served.backend.adapters.unload(name)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def admin_post(api: RunningApi, path: str, body: Any, token: str | None = ADMIN_TOKEN) -> httpx.Response:
    return httpx.post(f"{api.http_url}{path}", json=body, headers=bearer(token) if token else {}, timeout=60)


def load(api: RunningApi, name: str, path: Path, token: str | None = ADMIN_TOKEN) -> httpx.Response:
    return admin_post(api, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, token)


def complete(api: RunningApi, model: str, prompt: list[int]) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW, "ignore_eos": True}
    return httpx.post(f"{api.http_url}/v1/completions", json=body, headers=bearer(API_TOKEN), timeout=120)


def model_ids(api: RunningApi) -> list[tuple[str, str | None]]:
    got = httpx.get(f"{api.http_url}/v1/models", headers=bearer(API_TOKEN), timeout=10)
    assert got.status_code == 200, got.text
    return [(m["id"], m["parent"]) for m in got.json()["data"]]


def grpc_tokens(api: RunningApi, model: str, prompt: list[int]) -> list[int]:
    with Client(api.grpc_target, token=API_TOKEN) as client:
        return client.generate(prompt_token_ids=prompt, model=model, max_tokens=NEW, ignore_eos=True).token_ids


# ---------------------------------------------------------------------------- HTTP


def test_a_loaded_adapter_serves_its_own_tokens_and_is_listed(api: RunningApi, files: Files) -> None:
    loaded = load(api, "good", files.good)
    assert loaded.status_code == 200, loaded.text
    info = loaded.json()
    assert (info["name"], info["path"], info["rank"], info["base_model"]) == ("good", str(files.good), 8, "")
    assert info["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert len(info["digest"]) == 32 and info["load_ms"] > 0 and info["loaded_at"] > 0
    assert model_ids(api) == [(BASE, None), ("good", BASE)]
    cards = httpx.get(f"{api.http_url}/v1/models", headers=bearer(API_TOKEN), timeout=10).json()["data"]
    assert cards[1]["root"] == str(files.good) and cards[0]["root"] == BASE
    # the adapter's tokens are transformers + peft's, not the base model's
    assert grpc_tokens(api, "good", files.prompt) == files.expected != grpc_tokens(api, BASE, files.prompt)
    adapted, base = complete(api, "good", files.prompt), complete(api, BASE, files.prompt)
    assert adapted.status_code == base.status_code == 200
    assert adapted.json()["model"] == "good"
    assert adapted.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]
    listed = httpx.get(f"{api.http_url}/v1/lora_adapters", headers=bearer(ADMIN_TOKEN), timeout=10).json()
    assert listed == {"object": "list", "data": [info]}


def test_unloading_makes_requests_for_it_a_404(api: RunningApi, files: Files) -> None:
    assert load(api, "good", files.good).status_code == 200
    gone = admin_post(api, "/v1/unload_lora_adapter", {"lora_name": "good"})
    assert gone.status_code == 200 and gone.json()["name"] == "good"
    refused = complete(api, "good", files.prompt)
    assert refused.status_code == 404
    error = refused.json()["error"]
    assert error["param"] == "model" and "'good' is not served here" in error["message"]
    assert BASE in error["message"]
    assert model_ids(api) == [(BASE, None)]
    again = admin_post(api, "/v1/unload_lora_adapter", {"lora_name": "good"})
    assert again.status_code == 404 and "no adapter named 'good' is loaded" in again.json()["error"]["message"]


@pytest.mark.parametrize("case", ["missing folder", "no safetensors", "rank over the maximum",
                                  "another family's shapes", "lm_head", "another base model"])
def test_an_adapter_the_base_cannot_serve_is_refused_with_its_reason(api: RunningApi, files: Files,
                                                                      case: str) -> None:
    path, reason = files.bad[case]
    refused = load(api, "bad", path)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "lora_path" and reason in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert model_ids(api) == [(BASE, None)] and complete(api, "bad", files.prompt).status_code == 404


def test_names_bodies_and_conflicts(api: RunningApi, files: Files) -> None:
    for name in ("bad name", BASE):
        refused = load(api, name, files.good)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "lora_name"
    assert admin_post(api, "/v1/load_lora_adapter", {"lora_name": "x"}).json()["error"]["param"] == "lora_path"
    extra = admin_post(api, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(files.good), "rank": 2})
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "rank"
    first = load(api, "good", files.good).json()
    assert load(api, "good", files.good).json() == first  # the same files again: a no-op
    conflict = load(api, "good", files.second)
    assert conflict.status_code == 409 and "unload it first" in conflict.json()["error"]["message"]
    assert load(api, "second", files.second).json()["rank"] == 4
    assert [n for n, _ in model_ids(api)] == [BASE, "good", "second"]


def test_the_admin_api_needs_an_admin_token(api: RunningApi, files: Files) -> None:
    for token in (None, API_TOKEN, "wrong"):
        refused = load(api, "good", files.good, token)
        assert refused.status_code == 401, (token, refused.text)
        assert refused.json()["error"]["type"] == "authentication_error"
    listed = httpx.get(f"{api.http_url}/v1/lora_adapters", headers=bearer(API_TOKEN), timeout=10)
    assert listed.status_code == 401
    doc = httpx.get(f"{api.http_url}/openapi.json", timeout=10).json()
    op = doc["paths"]["/v1/load_lora_adapter"]["post"]
    assert op["security"] == [{"admin": []}] and "401" in op["responses"] and "403" not in op["responses"]
    assert doc["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]


def test_without_admin_tokens_the_admin_api_is_closed(scripted: RunningApi) -> None:
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}),
                       ("/v1/unload_lora_adapter", {"lora_name": "a"})):
        refused = admin_post(scripted, path, body)
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["type"] == "permission_error" and "--admin-token-file" in error["message"]
        assert "HALFMOON_ADMIN_TOKENS" in error["message"]
    assert httpx.get(f"{scripted.http_url}/v1/lora_adapters", timeout=10).status_code == 403
    with Client(scripted.grpc_target) as client, pytest.raises(PermissionDeniedError) as denied:
        client.adapters()
    assert "--admin-token-file" in denied.value.message
    op = httpx.get(f"{scripted.http_url}/openapi.json", timeout=10).json()["paths"]["/v1/lora_adapters"]["get"]
    assert "security" not in op and "403" in op["responses"] and "401" not in op["responses"]


# ---------------------------------------------------------------------------- under traffic

LONG = 150  # tokens of the streams that must outlive the unload


def test_load_and_unload_under_traffic_fail_no_request(api: RunningApi, files: Files) -> None:
    """Clients stream requests for the base model, adapter `good` and adapter `second` while an
    admin loads `second` and unloads `good`. No request fails: each is answered in full (its
    model's tokens) or, for an adapter not loaded when it was sent, with a 404 naming it; a
    `good` stream running when `good` is unloaded finishes with all its tokens."""
    assert load(api, "good", files.good).status_code == 200
    expected = {"good": _text(api, "good", LONG), BASE: _text(api, BASE, LONG)}
    assert load(api, "second", files.second).status_code == 200
    expected["second"] = _text(api, "second", LONG)
    assert admin_post(api, "/v1/unload_lora_adapter", {"lora_name": "second"}).status_code == 200
    outcomes = asyncio.run(_traffic(api, files))
    assert len(outcomes) == 3 * 8 + 1
    for o in outcomes:
        assert o.status in (200, 404), o
        if o.status == 200:
            assert o.text == expected[o.model], o
        else:  # a 404 only for an adapter not loaded when it was sent, naming it
            assert o.model != BASE and not o.loaded_at_send and f"'{o.model}' is not served here" in o.text, o
    loaded_while_sent = [o for o in outcomes if o.loaded_at_send]
    assert loaded_while_sent and all(o.status == 200 for o in loaded_while_sent)
    assert any(o.model == "good" and o.status == 404 for o in outcomes)  # after the unload
    assert any(o.model == "second" and o.status == 200 for o in outcomes)  # after the load
    held = [o for o in outcomes if o.held_over_unload]
    assert len(held) == 1 and held[0].status == 200 and held[0].text == expected["good"]


class _Outcome(NamedTuple):
    model: str
    loaded_at_send: bool  # its adapter was loaded (and not unloading) when it was sent
    status: int
    text: str
    held_over_unload: bool = False


def _text(api: RunningApi, model: str, max_tokens: int) -> str:
    body = {"model": model, "prompt": prompts(1)[0], "max_tokens": max_tokens, "ignore_eos": True}
    got = httpx.post(f"{api.http_url}/v1/completions", json=body, headers=bearer(API_TOKEN), timeout=120)
    assert got.status_code == 200, got.text
    return got.json()["choices"][0]["text"]


async def _traffic(api: RunningApi, files: Files) -> list[_Outcome]:
    """3 clients x 8 requests (base, good, second in turn) + one `good` stream held open across
    the unload; the admin acts once enough requests have finished (events, never sleeps)."""
    loaded = {BASE: True, "good": True, "second": False}
    done: list[_Outcome] = []
    enough = {n: asyncio.Event() for n in (4, 10)}
    streaming, unloaded = asyncio.Event(), asyncio.Event()
    headers = bearer(API_TOKEN)
    async with httpx.AsyncClient(base_url=api.http_url, headers=headers, timeout=120) as client:

        async def one(model: str) -> None:
            sent_loaded = loaded[model]
            body = {"model": model, "prompt": prompts(1)[0], "max_tokens": LONG, "ignore_eos": True}
            r = await client.post("/v1/completions", json=body)
            text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
            done.append(_Outcome(model, sent_loaded, r.status_code, text))
            for n, event in enough.items():
                if len(done) >= n:
                    event.set()

        async def user(k: int) -> None:
            for i in range(8):
                await one([BASE, "good", "second"][(i + k) % 3])

        async def held() -> None:  # a `good` stream whose first token came before the unload
            body = {"model": "good", "prompt": prompts(1)[0], "max_tokens": LONG, "ignore_eos": True, "stream": True}
            parts: list[str] = []
            async with client.stream("POST", "/v1/completions", json=body) as r:
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {"):
                        parts.append(json.loads(line[6:])["choices"][0]["text"])
                        break
                streaming.set()
                await asyncio.wait_for(unloaded.wait(), 60)
                async for line in lines:
                    if line.startswith("data: {"):
                        parts.append(json.loads(line[6:])["choices"][0]["text"])
            done.append(_Outcome("good", True, r.status_code, "".join(parts), held_over_unload=True))

        async def admin() -> None:
            await asyncio.wait_for(enough[4].wait(), 120)
            assert (await asyncio.to_thread(load, api, "second", files.second)).status_code == 200
            loaded["second"] = True
            await asyncio.wait_for(asyncio.gather(enough[10].wait(), streaming.wait()), 120)
            loaded["good"] = False  # from here a `good` request may meet the unload
            assert (await asyncio.to_thread(admin_post, api, "/v1/unload_lora_adapter",
                                            {"lora_name": "good"})).status_code == 200
            unloaded.set()

        await asyncio.wait_for(asyncio.gather(admin(), held(), *(user(k) for k in range(3))), 300)
    return done


# ---------------------------------------------------------------------------- gRPC, SDK, CLI


def test_grpc_load_list_generate_unload(api: RunningApi, files: Files) -> None:
    admin, user = (("authorization", f"Bearer {ADMIN_TOKEN}"),), (("authorization", f"Bearer {API_TOKEN}"),)
    with grpc.insecure_channel(api.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        info = stub.LoadAdapter(pb.LoadAdapterRequest(name="good", path=str(files.good)), metadata=admin)
        assert (info.name, info.rank, len(info.target_modules)) == ("good", 8, 7)
        assert [a.name for a in stub.ListAdapters(pb.ListAdaptersRequest(), metadata=admin).adapters] == ["good"]
        models = stub.ListModels(pb.ListModelsRequest(), metadata=user).models
        assert [(m.id, m.parent) for m in models] == [(BASE, ""), ("good", BASE)]
        request = pb.GenerateRequest(model="good", prompt_token_ids=files.prompt, max_tokens=NEW, ignore_eos=True)
        assert [t for r in stub.Generate(request, metadata=user) for t in r.token_ids] == files.expected
        with pytest.raises(grpc.RpcError) as unauthenticated:
            stub.ListAdapters(pb.ListAdaptersRequest(), metadata=user)
        assert unauthenticated.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as bad:
            stub.LoadAdapter(pb.LoadAdapterRequest(name="x", path=str(files.bad["lm_head"][0])), metadata=admin)
        assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "lm_head" in bad.value.details()
        assert _violated_field(bad.value) == "path"
        assert stub.UnloadAdapter(pb.UnloadAdapterRequest(name="good"), metadata=admin).digest == info.digest
        with pytest.raises(grpc.RpcError) as missing:
            list(stub.Generate(request, metadata=user))
        assert missing.value.code() is grpc.StatusCode.NOT_FOUND


def _violated_field(error: grpc.RpcError) -> str:
    for detail in rpc_status.from_call(error).details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            return bad.field_violations[0].field
    raise AssertionError("no BadRequest detail")


def test_the_sdk_loads_lists_and_unloads(api: RunningApi, files: Files) -> None:
    with Client(api.grpc_target, token=API_TOKEN, admin_token=ADMIN_TOKEN) as client:
        info = client.load_adapter("good", files.good)
        assert (info.name, info.path, info.rank) == ("good", str(files.good), 8)
        assert client.adapters() == [info]
        assert [(m.id, m.parent) for m in client.models()] == [(BASE, ""), ("good", BASE)]
        assert client.generate(prompt_token_ids=files.prompt, model="good", max_tokens=NEW,
                               ignore_eos=True).token_ids == files.expected
        with pytest.raises(InvalidArgumentError) as refused:
            client.load_adapter("rank", files.bad["rank over the maximum"][0])
        assert refused.value.field == "path" and "--max-lora-rank 16" in refused.value.message
        assert client.unload_adapter("good") == info
        with pytest.raises(NotFoundError):
            client.generate(prompt_token_ids=files.prompt, model="good", max_tokens=2)
    with Client(api.grpc_target, token=API_TOKEN) as user, pytest.raises(UnauthenticatedError):
        user.load_adapter("good", files.good)

    async def main() -> list[str]:
        async with AsyncClient(api.grpc_target, token=API_TOKEN, admin_token=ADMIN_TOKEN) as client:
            await client.load_adapter("second", files.second)
            names = [a.name for a in await client.adapters()]
            await client.unload_adapter("second")
            return names + [a.name for a in await client.adapters()]

    assert asyncio.run(main()) == ["second"]


def test_halfmoon_client_adapters(api: RunningApi, files: Files, tokens: tuple[Path, Path]) -> None:
    conn = ["--target", api.grpc_target, "--token-file", str(tokens[0]), "--admin-token-file", str(tokens[1])]

    def client(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CLI, "client", "adapters", *args, *conn], capture_output=True, text=True,
                              timeout=120, env=ENV)

    loaded = client("load", "good", str(files.good), "--json")
    assert loaded.returncode == 0, loaded.stderr
    assert [(a["name"], a["rank"]) for a in json.loads(loaded.stdout)] == [("good", 8)]
    table = client("list")
    assert table.returncode == 0 and table.stdout.split("\n")[0].split() == ["NAME", "RANK", "TARGETS", "PATH"]
    assert table.stdout.split("\n")[1].split()[:2] == ["good", "8"]
    refused = client("load", "bad", str(files.bad["missing folder"][0]))
    assert refused.returncode == 2 and "INVALID_ARGUMENT" in refused.stderr and "is not a folder" in refused.stderr
    unloaded = client("unload", "good")
    assert unloaded.returncode == 0 and unloaded.stdout.startswith("unloaded good (rank 8")
    assert json.loads(client("list", "--json").stdout) == []


# ---------------------------------------------------------------------------- serve --lora


def _serve(files: Files, *args: str, log: Path) -> subprocess.Popen[str]:
    with open(log, "w") as out:
        return subprocess.Popen([*CLI, "serve", "--colocated", "--model", str(files.base), "--served-model-name", BASE,
                                 "--grpc-port", "0", "--http-port", "0", "--threads", "1", "--no-redis",
                                 "--dtype", "float32", "--no-dashboard", "--cost-model", files.cost, *args], stdout=out, stderr=out, text=True,
                                env=ENV | {"PYTHONUNBUFFERED": "1"})


def test_serve_loads_lora_flags_at_start(files: Files, tmp_path: Path) -> None:
    """Each --lora is served from the start; --lora-skip-base-check reaches the engine (an adapter
    trained on another base model, refused by default, is served)."""
    log = tmp_path / "serve.log"
    other = files.bad["another base model"][0]
    proc = _serve(files, "--lora", f"good={files.good}", "--lora", f"second={files.second}",
                  "--lora", f"other={other}", "--lora-skip-base-check", log=log)
    try:
        def listening() -> re.Match[str] | None:
            assert proc.poll() is None, log.read_text()
            return re.search(r"listening grpc=\S+ http=(http://\S+)", log.read_text())

        match = poll(listening, 180)
        assert match, log.read_text()
        url = match.group(1)
        assert "LoRA adapters (request `model`): good, other, second" in log.read_text()
        cards = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        assert [(m["id"], m["parent"]) for m in cards] == [(BASE, None), ("good", BASE), ("other", BASE),
                                                            ("second", BASE)]
        body = {"model": "good", "prompt": files.prompt, "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).json()["usage"]["completion_tokens"] == 4
        assert httpx.get(url + "/v1/lora_adapters", timeout=10).status_code == 403  # no admin tokens given
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_exits_with_the_reason_of_a_bad_lora_flag(files: Files, tmp_path: Path) -> None:
    """--max-lora-rank reaches the engine: a rank-8 adapter over a rank-4 limit stops serve."""
    log = tmp_path / "serve.log"
    proc = _serve(files, "--lora", f"good={files.good}", "--max-lora-rank", "4", log=log)
    try:
        assert proc.wait(timeout=300) == 2, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert f"halfmoon: error: --lora good={files.good}: adapter good: rank 8" in text, text
    assert "--max-lora-rank 4" in text and "Traceback" not in text and "listening" not in text
