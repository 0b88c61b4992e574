"""Structured logs: one JSON object per record, with the request's ids where a request is being
served (bound in its task, seen by what it starts), and none outside one."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator

import pytest

from halfmoon.cli.components import LOGGING
from halfmoon.cli.flags import build
from halfmoon.cli.main import parse_args
from halfmoon.core.errors import ConfigError
from halfmoon.core.logs import JsonFormatter, LogConfig, bind_request, configure_logging, current_request

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def record(message: str, exc: BaseException | None = None) -> logging.LogRecord:
    info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord("halfmoon.test", logging.WARNING, __file__, 1, message, (), info)


def test_a_record_outside_a_request_has_no_ids() -> None:
    async def outside() -> dict:
        return json.loads(JsonFormatter().format(record("plain %s")))

    out = asyncio.run(outside())
    assert out["message"] == "plain %s" and out["level"] == "warning" and out["logger"] == "halfmoon.test"
    assert "request_id" not in out and "trace_id" not in out and out["time"].endswith("Z")


def test_a_bound_request_reaches_its_records_and_the_threads_it_starts() -> None:
    async def serve() -> list[dict]:
        bind_request("req-1", TRACEPARENT)
        here = json.loads(JsonFormatter().format(record("in the task")))
        there = json.loads(await asyncio.to_thread(lambda: JsonFormatter().format(record("in a thread"))))
        return [here, there]

    for out in asyncio.run(serve()):
        assert (out["request_id"], out["trace_id"], out["span_id"]) == (
            "req-1", "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
    assert current_request() is None  # the task's binding stayed in the task


def test_an_exception_is_in_the_record() -> None:
    try:
        raise ValueError("boom")
    except ValueError as e:
        out = json.loads(JsonFormatter().format(record("failed", e)))
    assert "ValueError: boom" in out["exception"]


@pytest.fixture
def root_handlers() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_configure_installs_one_json_handler(root_handlers: None, capsys: pytest.CaptureFixture) -> None:
    configure_logging(LogConfig("json", "info"))
    configure_logging(LogConfig("json", "info"))  # again: still one handler
    ours = [h for h in logging.getLogger().handlers if getattr(h, "halfmoon", False)]
    assert len(ours) == 1 and isinstance(ours[0].formatter, JsonFormatter)
    assert logging.getLogger().level == logging.INFO


def test_flags_env_and_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    assert build(LOGGING, parse_args(["serve"])) == LogConfig()
    monkeypatch.setenv("HALFMOON_LOG_FORMAT", "json")
    assert build(LOGGING, parse_args(["serve", "--log-level", "info"])) == LogConfig("json", "info")
    with pytest.raises(ConfigError):
        LogConfig("xml")
    with pytest.raises(ConfigError):
        LogConfig("json", "loud")
