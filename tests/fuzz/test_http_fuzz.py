"""Schemathesis against the published OpenAPI document of a live front door (tests/fuzz/conftest.py).

Every operation, positive and negative cases, every check Schemathesis has: no 5xx, no response
outside the document (status, content type, headers, body schema), schema-valid data served and
invalid data refused, auth not ignored, no response slower than `--max-response-time`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from tests.conductor.conftest import RunningApi
from tests.fuzz.conftest import TOKEN, FuzzBudget, report_dir

MAX_RESPONSE_S = 30.0


def schemathesis(api: RunningApi, budget: FuzzBudget, reports: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "schemathesis.cli", "run", f"{api.http_url}/openapi.json", "--checks", "all",
            "-H", f"Authorization: Bearer {TOKEN}", "--seed", str(budget.seed), "--workers", "1",
            "--max-examples", str(budget.cases), "--request-timeout", str(MAX_RESPONSE_S),
            "--max-response-time", str(MAX_RESPONSE_S), "--report", "junit,ndjson", "--report-dir", str(reports),
            "--no-color", *extra]
    if budget.long:
        args += ["--max-time", str(int(budget.minutes * 60))]
    return subprocess.run(args, capture_output=True, text=True, timeout=budget.minutes * 60 + 900)


def test_the_document_lists_every_route(fuzz_api: RunningApi) -> None:
    doc = httpx.get(f"{fuzz_api.http_url}/openapi.json", timeout=10).json()
    assert doc["openapi"] == "3.1.0"
    assert set(doc["paths"]) >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                                 "/dashboard", "/dashboard/api/live", "/dashboard/api/sizing/jobs/{job_id}"}
    assert doc["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/health"]["get"]
