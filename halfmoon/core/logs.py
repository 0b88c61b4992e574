"""Log output: Python's default (text) or one JSON object per line, carrying the request id and
trace id of the request being served where there is one.

    configure_logging(LogConfig("json", "info"))      # once per process (the CLI, each worker)
    bind_request(request_id, trace_id)                 # where a request's work starts (its task)

The request's ids live in a context variable: set at the start of a request's task (the front
door's handler, a worker's verb), they reach every record logged in that task and in what it
starts (tasks and `asyncio.to_thread` copy the context). A record outside any request has none.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import NamedTuple

from halfmoon.core.errors import ConfigError

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True, slots=True)
class LogConfig:
    """How a process logs.

    log_format: `text` (Python's default: warnings and errors, the message alone) or `json`
        (one object per line: time, level, logger, message, request_id, trace_id, span_id).
    log_level: the lowest level logged (debug, info, warning, error).
    """

    log_format: str = "text"
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if self.log_format not in FORMATS:
            raise ConfigError(f"log_format {self.log_format!r}: choose one of {', '.join(FORMATS)}")
        if self.log_level not in LEVELS:
            raise ConfigError(f"log_level {self.log_level!r}: choose one of {', '.join(LEVELS)}")


class RequestIds(NamedTuple):
    request_id: str | None
    trace_id: str | None
    span_id: str | None = None


_REQUEST: ContextVar[RequestIds | None] = ContextVar("halfmoon_request", default=None)


def bind_request(request_id: str | None, traceparent: str | None = None) -> None:
    """The request (and its trace, from a W3C traceparent) whose work the current task does.
    Never reset: the task ends with the request."""
    trace_id = span_id = None
    if traceparent is not None:
        parts = traceparent.split("-")
        if len(parts) == 4:
            trace_id, span_id = parts[1], parts[2]
    _REQUEST.set(RequestIds(request_id, trace_id, span_id))


def current_request() -> RequestIds | None:
    return _REQUEST.get()


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see LogConfig.log_format)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                    + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage(),
            "process": record.process}
        ids = _REQUEST.get()
        if ids is not None:
            out.update((k, v) for k, v in ids._asdict().items() if v is not None)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(config: LogConfig) -> None:
    """Install the configured output on the root logger (text at `warning`: left as Python's
    default). Replaces a handler this function installed before, so calling it twice is safe."""
    if config.log_format == "text" and config.log_level == "warning":
        return
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "halfmoon", False)]:
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.halfmoon = True  # type: ignore[attr-defined]
    handler.setFormatter(JsonFormatter() if config.log_format == "json"
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(config.log_level.upper())
