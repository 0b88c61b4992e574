"""The dashboard's HTTP side over a real front door and a real co-located engine, auth on:
sign-in, the live document, the sizing jobs and their errors, Helm values the chart accepts."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
import yaml

from halfmoon.conductor.colocated import ColocatedBackend
from halfmoon.conductor.cost_model import CostModel
from halfmoon.api.server import ServerConfig
from halfmoon.dashboard.routes import COOKIE, mount
from tests.conductor.conftest import MODEL, RunningApi, run_api
from tests.conftest import EngineFactory
from tests.deploy.values import drop_nulls, merge
from tests.waiting import poll

CHART = Path(__file__).resolve().parents[2] / "helm" / "halfmoon"
TOKEN = "dash-token-1"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def board(make_engine: EngineFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningApi]:
    tokens = tmp_path_factory.mktemp("auth") / "tokens"
    tokens.write_text(f"# the dashboard test's token\n{TOKEN}\n")
    backend = ColocatedBackend(make_engine(num_blocks=256), MODEL)
    api = run_api(backend, ServerConfig(grpc_port=0, http_port=0, api_token_file=str(tokens)), [mount])
    yield api
    api.stop()


@pytest.fixture
def http(board: RunningApi) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=board.http_url, timeout=30) as client:
        yield client


def complete(http: httpx.Client, prompt: str, max_tokens: int = 8) -> None:
    r = http.post("/v1/completions", headers=AUTH,
                  json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text


def test_without_a_token_the_page_is_a_401_sign_in_form(http: httpx.Client) -> None:
    r = http.get("/dashboard")
    assert r.status_code == 401 and "text/html" in r.headers["content-type"]
    assert 'action="/dashboard/login"' in r.text and 'name="token"' in r.text
    assert http.get("/dashboard/static/style.css").status_code == 200  # the form is styled
    api = http.get("/dashboard/api/live")
    assert api.status_code == 401 and api.json()["error"]["type"] == "authentication_error"


def test_a_wrong_token_says_so_and_a_right_one_signs_in_with_a_cookie(http: httpx.Client) -> None:
    wrong = http.post("/dashboard/login", data={"token": "nope"})
    assert wrong.status_code == 401 and "invalid bearer token" in wrong.text
    right = http.post("/dashboard/login", data={"token": TOKEN})
    assert right.status_code == 303 and right.headers["location"] == "/dashboard"
    cookie = right.headers["set-cookie"]
    assert f"{COOKIE}=" in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie
    page = http.get("/dashboard")  # the client kept the cookie
    assert page.status_code == 200 and "/dashboard/static/app.js" in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert http.get("/dashboard/api/live").status_code == 200
    http.post("/dashboard/logout")
    assert http.get("/dashboard").status_code == 401


def test_live_document_counts_finished_requests_and_the_engine(http: httpx.Client) -> None:
    before = http.get("/dashboard/api/live", headers=AUTH).json()
    complete(http, "The capital of France is")
    complete(http, "Write a haiku about the sea")
    doc = poll(lambda: (d := http.get("/dashboard/api/live", headers=AUTH).json())["cluster"]["finished"]
               >= before["cluster"]["finished"] + 2 and d, 10)
    assert doc, "the live document did not count the two requests"
    assert doc["mode"] == "colocated" and doc["model"] == MODEL and doc["ready"] is True
    assert doc["planner"] is None  # one engine: no pools to re-balance, the page hides the panel
    assert doc["slo"] == {"ttft_ms": 2000.0, "tbt_ms": 150.0}
    assert doc["admission"]["classes"]["batch"] == {"ttft_ms": None, "tbt_ms": None}
    (engine,) = doc["workers"]
    assert engine["id"] == "engine" and engine["alive"] and engine["steps"] > before["workers"][0]["steps"]
    assert engine["kv"]["device"]["total"] == 256 and engine["kv"]["host"] is None
    assert engine["prompt_tokens_computed"] > 0
    s = doc["series"]
    assert len(s["t"]) == len(s["ttft_ms"]["p50"]) == len(s["request_rate"]) == 120
    assert any(v is not None and v > 0 for v in s["ttft_ms"]["p99"])
    assert doc["cluster"]["request_rate"] > 0 and doc["cluster"]["slo_attainment"] is not None


def test_sizing_options_offer_the_sample_live_traffic_and_profiles(http: httpx.Client) -> None:
    complete(http, "Recorded for the live trace")
    options = http.get("/dashboard/api/sizing/options", headers=AUTH).json()
    traces = {t["name"]: t for t in options["traces"]}
    assert traces["sample"]["requests"] > 100 and traces["live"]["requests"] >= 1
    names = [p["name"] for p in options["profiles"]]
    assert names[0] == "this-cluster" and "llama3-8b-h100" in names
    assert options["defaults"]["device_tokens"] == [256 * 16]


def test_the_cost_model_admission_prices_with_is_served_as_a_profile(http: httpx.Client, board: RunningApi) -> None:
    assert http.get("/dashboard/api/cost-model").status_code == 401
    r = http.get("/dashboard/api/cost-model", headers=AUTH)
    assert r.status_code == 200, r.text
    assert CostModel.from_json(r.text) == board.backend.cost


SWEEP = {"trace": "sample", "profile": "llama3-8b-a100", "workers": 3, "device_tokens": [16384, 65536],
         "host_tokens": [0], "ttft_ms": 5000, "tbt_ms": 300, "speed": 4}


@pytest.mark.parametrize(("change", "param"), [
    ({"workers": 1}, "workers"),
    ({"device_tokens": "lots"}, "device_tokens"),
    ({"trace": "mine"}, "trace"),
    ({"trace": "upload", "trace_text": '{"timestamp": 0}\n'}, "trace_text"),
    ({"profile": "gpt-9"}, "profile"),
    ({"ttft_ms": -1}, "ttft_ms"),
])
def test_a_bad_sizing_field_is_a_400_naming_it(http: httpx.Client, change: dict, param: str) -> None:
    r = http.post("/dashboard/api/sizing/jobs", headers=AUTH, json={**SWEEP, **change})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_sweep_runs_in_the_background_once_at_a_time_and_ends_in_helm_values(http: httpx.Client) -> None:
    started = http.post("/dashboard/api/sizing/jobs", headers=AUTH, json=SWEEP)
    assert started.status_code == 202, started.text
    job = started.json()
    assert job["state"] == "running" and job["total"] == 4
    second = http.post("/dashboard/api/sizing/jobs", headers=AUTH, json=SWEEP)
    assert second.status_code == 409 and job["id"] in second.json()["error"]["message"]
    done = poll(lambda: (j := http.get(f"/dashboard/api/sizing/jobs/{job['id']}", headers=AUTH).json())["state"]
                != "running" and j, 120)
    assert done and done["state"] == "done", done
    assert done["done"] == 4 and len(done["rows"]) == 4
    best = done["best"]
    assert best["goodput_per_worker"] == max(r["goodput_per_worker"] for r in done["rows"])
    values = http.get(f"/dashboard/api/sizing/jobs/{job['id']}/values.yaml", headers=AUTH)
    assert values.status_code == 200 and "attachment" in values.headers["content-disposition"]
    snippet = yaml.safe_load(values.text)
    assert snippet["prefill"]["replicas"] == best["prefill"] and snippet["decode"]["replicas"] == best["decode"]
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator(schema).validate(drop_nulls(merge(yaml.safe_load((CHART / "values.yaml").read_text()),
                                                                 snippet)))
    assert http.get("/dashboard/api/sizing/jobs/sweep-999", headers=AUTH).status_code == 404


def test_an_uploaded_trace_is_replayed(http: httpx.Client, board: RunningApi) -> None:
    lines = [json.dumps({"timestamp": 500 * i, "input_length": 700, "output_length": 20, "hash_ids": [1, i + 2]})
             for i in range(10)]
    body = {**SWEEP, "trace": "upload", "trace_text": "\n".join(lines), "device_tokens": [65536],
            "profile": "this-cluster"}
    started: Callable[[], httpx.Response] = lambda: http.post("/dashboard/api/sizing/jobs", headers=AUTH, json=body)
    r = poll(lambda: (resp := started()).status_code != 409 and resp, 120)  # the last test's sweep may still run
    assert r and r.status_code == 202, r.text if r else "a sweep kept running"
    job = r.json()
    done = poll(lambda: (j := http.get(f"/dashboard/api/sizing/jobs/{job['id']}", headers=AUTH).json())["state"]
                != "running" and j, 120)
    assert done and done["state"] == "done" and done["source"] == "uploaded trace"
    assert all(row["requests"] == 10 for row in done["rows"])


def test_halfmoon_dashboard_prints_the_address_of_a_running_cluster(board: RunningApi,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from halfmoon.cli.main import main

    assert main(["dashboard", "--url", board.http_url]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{board.http_url}/dashboard") and "cluster ok" in out and "sign in" in out
    assert main(["dashboard", "--url", "http://127.0.0.1:9", "--timeout-s", "1"]) == 2
    assert "no Halfmoon server answers at http://127.0.0.1:9" in capsys.readouterr().err


def test_the_recorded_traffic_downloads_as_a_mooncake_trace(http: httpx.Client) -> None:
    complete(http, "Recorded " * 40)
    r = http.get("/dashboard/api/traffic.jsonl", params={"minutes": 5}, headers=AUTH)
    assert r.status_code == 200 and "attachment" in r.headers["content-disposition"]
    from halfmoon.sim.trace import parse_line

    rows = [parse_line(line, n) for n, line in enumerate(r.text.splitlines(), start=1)]
    assert rows and rows[0].timestamp == 0 and rows[-1].input_length > 40
    assert http.get("/dashboard/api/traffic.jsonl", params={"minutes": "x"}, headers=AUTH).json()[
        "error"]["param"] == "minutes"
