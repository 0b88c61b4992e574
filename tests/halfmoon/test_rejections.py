"""The SDK and `halfmoon client` on admission: the priority class a request names, the prediction
on an admitted request's result, a rejection as a typed error (reason, retry hint, prediction),
retrying a rejection after the server's hint only when asked, and the CLI's one-line report.

The server is the real front door over a scripted backend (tests/conductor/conftest.py): each
test says which rejections it answers with before it admits a request.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys

import grpc
import pytest

from halfmoon.conductor.errors import OverloadedError, SloMissError
from halfmoon.core.messages import SloPrediction
from halfmoon.client import (TOKEN_ENV, AsyncClient, Client, ResourceExhaustedError, RetryEvent,
                             RetryPolicy, api_error)
from tests.conductor import conftest as server_fixtures
from tests.conductor.conftest import RunningApi

# The scripted-server fixtures, bound here (see tests/halfmoon/test_client.py).
scripted, scripted_api = server_fixtures.scripted, server_fixtures.scripted_api

PROMPT = "The capital of France is"
CLI = [sys.executable, "-m", "halfmoon.cli.main", "client"]
ENV = {k: v for k, v in os.environ.items() if k != TOKEN_ENV} | {"PYTHONUNBUFFERED": "1"}
MISS = SloPrediction(predicted_ttft_ms=3100.0, predicted_tbt_ms=40.0, ttft_slo_ms=2000.0, tbt_slo_ms=150.0)


def ttft_miss(retry_after_s: float = 0.05) -> SloMissError:
    return SloMissError(MISS, retry_after_s, "ttft", "predicted TTFT 3100 ms > 2000 ms")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, env=ENV, check=False)


# ---------------------------------------------------------------------------------- admitted

def test_priority_class_is_sent_and_the_prediction_comes_back_typed(scripted: RunningApi) -> None:
    scripted.backend.prediction = SloPrediction(120.0, 30.0, 1000.0, 100.0)
    with Client(scripted.grpc_target) as client:
        result = client.generate(PROMPT, max_tokens=1, priority_class="interactive")
        last = list(client.stream(PROMPT, max_tokens=1))[-1]
        scripted.backend.prediction = None
        plain = client.generate(PROMPT, max_tokens=1)
    assert result.prediction == SloPrediction(120.0, 30.0, 1000.0, 100.0)
    assert last.result is not None and last.result.prediction == result.prediction
    assert plain.prediction is None
    assert [i.priority_class for i in scripted.backend.inputs] == ["interactive", None, None]


# ---------------------------------------------------------------------------------- rejections

def test_a_rejection_is_a_typed_error_and_not_retried_by_default(scripted: RunningApi) -> None:
    scripted.backend.rejections.append(ttft_miss(2.0))
    events: list[RetryEvent] = []
    with Client(scripted.grpc_target, on_retry=events.append) as client, \
            pytest.raises(ResourceExhaustedError) as e:
        client.generate(PROMPT, max_tokens=1)
    err = e.value
    assert err.rejected and err.reason == "ttft" and err.retry_after_s == pytest.approx(2.0)
    assert err.prediction == MISS and "3100 ms" in err.message
    assert events == [] and len(scripted.backend.inputs) == 1


def test_retry_rejected_waits_the_hint_and_retries_up_to_n_times(scripted: RunningApi) -> None:
    scripted.backend.rejections.extend([ttft_miss(0.05), OverloadedError("queue full", 0.1, "queue_full")])
    events: list[RetryEvent] = []
    with Client(scripted.grpc_target, retry_rejected=2, on_retry=events.append) as client:
        result = client.generate(PROMPT, max_tokens=1)
    assert result.token_ids == [scripted.backend.TOKEN]
    assert [(ev.retry, ev.error.reason) for ev in events] == [(1, "ttft"), (2, "queue_full")]
    assert 0.05 <= events[0].delay_s <= 0.06 and 0.1 <= events[1].delay_s <= 0.12  # the hint, +<=20%
    scripted.backend.rejections.extend([ttft_miss(), ttft_miss()])
    with Client(scripted.grpc_target, retry_rejected=1) as client, pytest.raises(ResourceExhaustedError) as e:
        client.generate(PROMPT, max_tokens=1)
    assert e.value.reason == "ttft" and len(scripted.backend.inputs) == 3 + 2


def test_async_client_retries_a_rejection_too(scripted: RunningApi) -> None:
    scripted.backend.rejections.append(ttft_miss())

    async def main() -> list[int]:
        async with AsyncClient(scripted.grpc_target, retry_rejected=1) as client:
            return (await client.generate(PROMPT, max_tokens=1, priority_class="batch")).token_ids

    assert asyncio.run(main()) == [scripted.backend.TOKEN]
    assert [i.priority_class for i in scripted.backend.inputs] == ["batch", "batch"]


def test_a_rejection_past_the_deadline_is_not_retried(scripted: RunningApi) -> None:
    scripted.backend.rejections.append(ttft_miss(5.0))
    with Client(scripted.grpc_target, retry_rejected=3, timeout=1.0) as client, \
            pytest.raises(ResourceExhaustedError):
        client.generate(PROMPT, max_tokens=1)  # waiting 5 s would pass the 1 s deadline
    assert len(scripted.backend.inputs) == 1


def test_the_policy_retries_rejections_only_when_asked() -> None:
    rejected = api_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", retry_after_s=1.0, reason="queue_full")
    too_large = api_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "body too large")  # no hint: not a rejection
    down = api_error(grpc.StatusCode.UNAVAILABLE, "down")
    assert rejected.rejected and not too_large.rejected and not down.rejected
    default, asked = RetryPolicy(), RetryPolicy(retry_rejected=2)
    assert not default.should_retry(rejected, retries=0, received=0)
    assert asked.should_retry(rejected, retries=0, received=0, rejected=1)
    assert not asked.should_retry(rejected, retries=0, received=0, rejected=2)
    assert not asked.should_retry(rejected, retries=0, received=1)  # never after a chunk
    assert not asked.should_retry(too_large, retries=0, received=0)
    assert asked.should_retry(down, retries=2, received=0, rejected=2)  # separate budgets
    rng = random.Random(0)
    assert all(1.0 <= RetryPolicy.rejected_delay_s(rejected, rng) <= 1.2 for _ in range(100))


# ---------------------------------------------------------------------------------- CLI

def test_cli_reports_a_rejection_in_one_line_and_exits_4(scripted: RunningApi) -> None:
    scripted.backend.rejections.append(ttft_miss(2.0))
    proc = run_cli("generate", PROMPT, "--priority-class", "interactive", "--target", scripted.grpc_target)
    assert proc.returncode == 4, (proc.stdout, proc.stderr)
    assert proc.stderr == ("halfmoon: rejected (429 / RESOURCE_EXHAUSTED, reason ttft): predicted TTFT 3100 ms "
                           "> SLO 2000 ms; retry after 2 s\n")
    scripted.backend.rejections.append(OverloadedError("9 requests are queued (limit 8)", 0.5, "queue_full"))
    proc = run_cli("generate", PROMPT, "--json", "--target", scripted.grpc_target)
    assert proc.returncode == 4 and "reason queue_full): 9 requests are queued (limit 8); retry after 0.5 s" \
        in proc.stderr
    assert [i.priority_class for i in scripted.backend.inputs] == ["interactive", None]


def test_cli_retry_rejected_then_succeeds(scripted: RunningApi) -> None:
    scripted.backend.rejections.append(ttft_miss(0.05))
    scripted.backend.prediction = SloPrediction(120.0, 30.0, 2000.0, 150.0)
    proc = run_cli("generate", PROMPT, "--retry-rejected", "1", "--target", scripted.grpc_target)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert proc.stdout == "x\n"
    first, summary = proc.stderr.splitlines()
    assert first.startswith("halfmoon: rejected (429 / RESOURCE_EXHAUSTED, reason ttft)") and "retrying in" in first
    assert "(predicted 120 ms)" in summary
    proc = run_cli("generate", PROMPT, "--priority-class", "vip", "--target", scripted.grpc_target)
    assert proc.returncode == 2 and "INVALID_ARGUMENT: priority_class: 'vip' is not a priority class" in proc.stderr
