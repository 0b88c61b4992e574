"""Schemathesis against the published OpenAPI document of a live front door (tests/fuzz/conftest.py).

Every operation, positive and negative cases, every check Schemathesis has: no 5xx, no response
outside the document (status, content type, headers, body and SSE event schemas), schema-valid
data served and invalid data refused, auth not ignored, no response slower than 30 s.

One operation is fuzzed with negative cases only: POST /dashboard/api/sizing/jobs, whose valid
requests each start a simulator sweep in a child process (one at a time, then 409) — minutes of
CPU per case on a shared machine; its refusals are what a fuzzer can hold it to.

The normal suite runs a few seeded cases per operation; `make fuzz` sets HALFMOON_FUZZ_CASES
(cases per operation) and HALFMOON_FUZZ_MINUTES (`--max-time`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx

from tests.conductor.conftest import RunningApi
from tests.fuzz.conftest import TOKEN, FuzzBudget, report_dir

MAX_RESPONSE_S = 30
HOOKS = Path(__file__).with_name("hooks.py")  # a cross-field rule JSON Schema cannot state
SIZING_JOBS = "/dashboard/api/sizing/jobs"


def schemathesis(api: RunningApi, budget: FuzzBudget, reports: Path, *extra: str,
                 timed: bool = True, adapter: Path | None = None) -> tuple[int, str]:
    """Run the Schemathesis CLI; (cases generated, its output). Fails the test on any failure."""
    args = [sys.executable, "-m", "schemathesis.cli", "run", f"{api.http_url}/openapi.json", "--checks", "all",
            "-H", f"Authorization: Bearer {TOKEN}", "--seed", str(budget.seed), "--workers", "1",
            "--max-examples", str(budget.cases), "--request-timeout", str(MAX_RESPONSE_S),
            "--max-response-time", str(MAX_RESPONSE_S), "--report", "junit", "--report-dir", str(reports),
            "--no-color", *extra]
    if budget.long and timed:
        args += ["--max-time", str(max(1, int(budget.minutes * 60)))]
    if not budget.long:  # the normal suite's pass: random cases only (the coverage phase's
        args += ["--phases", "examples,fuzzing"]  # boundary cases take minutes: `make fuzz`)
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS), "HALFMOON_FUZZ_ADAPTER": str(adapter or "")}
    done = subprocess.run(args, capture_output=True, text=True, timeout=budget.minutes * 60 + 1200, env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-20000:]
    cases = re.search(r"(\d+) generated", output)
    assert cases is not None, output[-4000:]
    return int(cases.group(1)), output


def test_the_document_lists_every_route(fuzz_api: RunningApi) -> None:
    doc = httpx.get(f"{fuzz_api.http_url}/openapi.json", timeout=10).json()
    assert doc["openapi"] == "3.1.0"
    assert set(doc["paths"]) >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                                 "/dashboard", "/dashboard/api/live", "/dashboard/api/sizing/jobs/{job_id}",
                                 "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/lora_adapters"}
    assert doc["paths"]["/v1/load_lora_adapter"]["post"]["security"] == [{"admin": []}]
    completions = doc["paths"]["/v1/completions"]["post"]
    assert completions["security"] == [{"bearer": []}]
    assert set(completions["responses"]) == {"200", "400", "401", "404", "413", "429", "503"}
    assert "security" not in doc["paths"]["/health"]["get"]
    assert doc["components"]["securitySchemes"]["bearer"] == {**doc["components"]["securitySchemes"]["bearer"],
                                                              "type": "http", "scheme": "bearer"}


def test_schemathesis_finds_nothing(fuzz_api: RunningApi, fuzz_budget: FuzzBudget, fuzz_adapter: Path,
                                    tmp_path: Path) -> None:
    reports = report_dir(tmp_path)
    cases, output = schemathesis(fuzz_api, fuzz_budget, reports / "all", "--exclude-path", SIZING_JOBS,
                                 adapter=fuzz_adapter)
    negative, _ = schemathesis(fuzz_api, fuzz_budget, reports / "sizing", "--include-name", f"POST {SIZING_JOBS}",
                               "--mode", "negative", "--suppress-health-check", "filter_too_much", timed=False)
    print(f"Schemathesis: {cases} cases over every other operation, {negative} negative on POST {SIZING_JOBS}")
    doc = httpx.get(f"{fuzz_api.http_url}/openapi.json", timeout=10).json()
    others = sum(len(ops) for ops in doc["paths"].values()) - 1
    assert f"Tested: {others}" in output and cases >= others and negative > 0
    assert fuzz_api.wait_idle(timeout=30) == []
