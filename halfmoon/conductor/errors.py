"""Errors of the front door, and the one table mapping every error to its gRPC status and HTTP code.

Internal code raises precise exception types; `status_of` is the only place that decides what a
client sees. Each class maps to exactly one (gRPC status, HTTP code, OpenAI error type):

| exception                          | gRPC                | HTTP | OpenAI `type`          |
|------------------------------------|---------------------|------|------------------------|
| InvalidRequestError (+ChatTemplate)| INVALID_ARGUMENT    | 400  | invalid_request_error  |
| InvalidAdapterError (LoRA)         | INVALID_ARGUMENT    | 400  | invalid_request_error  |
| ModelNotFoundError                 | NOT_FOUND           | 404  | not_found_error        |
| RequestTooLargeError               | RESOURCE_EXHAUSTED  | 413  | invalid_request_error  |
| RetryableRejection (every kind)    | RESOURCE_EXHAUSTED  | 429  | rate_limit_error       |
| ServiceUnavailableError            | UNAVAILABLE         | 503  | service_unavailable    |
| DeadlineExceededError              | DEADLINE_EXCEEDED   | 504  | timeout_error          |
| RequestAbortedError                | CANCELLED           | 499  | cancelled              |
| UnauthenticatedError               | UNAUTHENTICATED     | 401  | authentication_error   |
| PermissionDeniedError              | PERMISSION_DENIED   | 403  | permission_error       |
| anything else                      | INTERNAL            | 500  | internal_error         |

The rejections (TooManyStreamsError, OverloadedError, SloMissError, ...) are one row: load is
never a 5xx, whatever kind of rejection a backend raises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from halfmoon.core.adapters import InvalidAdapterError
from halfmoon.core.errors import HalfmoonError, InvalidRequestError
from halfmoon.core.messages import SloPrediction, WorkerError
from halfmoon.engine.errors import ChatTemplateError, RequestAbortedError


class ModelNotFoundError(HalfmoonError):
    """The request names a model this endpoint does not serve."""

    def __init__(self, model: str, served: list[str]) -> None:
        super().__init__(f"model {model!r} is not served here; available: {', '.join(served)}")
        self.field = "model"


class RequestTooLargeError(HalfmoonError):
    """The request body is over the configured size limit."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"request body of {size} bytes is larger than the limit of {limit} bytes")
        self.field = "body"


class RetryableRejection(HalfmoonError):
    """A rejection the client may retry after `retry_after_s` seconds. `reason` names why
    (admission's reasons, e.g. `ttft`, `queue_full`); `prediction` is what admission predicted."""

    def __init__(self, message: str, retry_after_s: float, reason: str = "",
                 prediction: SloPrediction | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = max(0.0, retry_after_s) if math.isfinite(retry_after_s) else 1.0
        self.reason = reason
        self.prediction = prediction


class TooManyStreamsError(RetryableRejection):
    """This client already has the maximum number of concurrent requests in flight."""


class OverloadedError(RetryableRejection):
    """The backend's queue is full; nothing was spent on the request."""


class SloMissError(OverloadedError):
    """The request would miss its TTFT or TBT objective: rejected before any work is spent."""

    def __init__(self, prediction: SloPrediction, retry_after_s: float, reason: str = "slo",
                 detail: str = "") -> None:
        p = prediction
        misses = [detail] if detail else []
        if not misses and p.ttft_slo_ms and p.predicted_ttft_ms > p.ttft_slo_ms:
            misses.append(f"predicted TTFT {p.predicted_ttft_ms:.0f} ms > SLO {p.ttft_slo_ms:.0f} ms")
        if not detail and p.tbt_slo_ms and p.predicted_tbt_ms > p.tbt_slo_ms:
            misses.append(f"predicted TBT {p.predicted_tbt_ms:.1f} ms > SLO {p.tbt_slo_ms:.1f} ms")
        super().__init__("request would miss its SLO: " + "; ".join(misses), retry_after_s, reason, prediction)


class ResourceNotFoundError(HalfmoonError):
    """A named resource of the server (e.g. a dashboard sizing job) does not exist."""


class ConflictError(HalfmoonError):
    """The request conflicts with the server's state (e.g. a sizing sweep is already running)."""


class ServiceUnavailableError(HalfmoonError):
    """The backend cannot serve right now (starting, stopping, or lost); retry with backoff."""


class DeadlineExceededError(HalfmoonError):
    """The request's deadline passed before it finished; its work was stopped and freed."""


class UnauthenticatedError(HalfmoonError):
    """Missing or wrong bearer token."""


class PermissionDeniedError(HalfmoonError):
    """The call is not open to this server's clients at all (e.g. the admin API of a server
    started without admin tokens); the message says how to open it. No token changes the answer."""


@dataclass(frozen=True, slots=True)
class ErrorStatus:
    grpc: grpc.StatusCode
    http: int
    openai_type: str


_STATUS: list[tuple[type[BaseException], ErrorStatus]] = [
    (InvalidRequestError, ErrorStatus(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error")),
    (ChatTemplateError, ErrorStatus(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error")),
    (InvalidAdapterError, ErrorStatus(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error")),
    (ModelNotFoundError, ErrorStatus(grpc.StatusCode.NOT_FOUND, 404, "not_found_error")),
    (ResourceNotFoundError, ErrorStatus(grpc.StatusCode.NOT_FOUND, 404, "not_found_error")),
    (ConflictError, ErrorStatus(grpc.StatusCode.FAILED_PRECONDITION, 409, "conflict_error")),
    (RequestTooLargeError, ErrorStatus(grpc.StatusCode.RESOURCE_EXHAUSTED, 413, "invalid_request_error")),
    (RetryableRejection, ErrorStatus(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error")),
    (ServiceUnavailableError, ErrorStatus(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable")),
    (WorkerError, ErrorStatus(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable")),
    (DeadlineExceededError, ErrorStatus(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error")),
    (RequestAbortedError, ErrorStatus(grpc.StatusCode.CANCELLED, 499, "cancelled")),
    (UnauthenticatedError, ErrorStatus(grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error")),
    (PermissionDeniedError, ErrorStatus(grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error")),
]
INTERNAL = ErrorStatus(grpc.StatusCode.INTERNAL, 500, "internal_error")


def status_of(error: BaseException) -> ErrorStatus:
    """The one status a client sees for `error` (INTERNAL for anything unexpected)."""
    for cls, status in _STATUS:
        if isinstance(error, cls):
            return status
    return INTERNAL


def field_of(error: BaseException) -> str | None:
    """The request field an error is about, when there is one."""
    if isinstance(error, ChatTemplateError):
        return "messages"
    if isinstance(error, InvalidAdapterError):  # an adapter a request names (the admin API names its own field)
        return getattr(error, "field", "model")
    return getattr(error, "field", None)


def client_message(error: BaseException) -> str:
    """The message a client sees: the error's own text, never a stack trace for a bug."""
    if status_of(error) is INTERNAL:
        return f"internal error ({type(error).__name__}); the server log has the details"
    return str(error)
