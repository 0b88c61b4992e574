"""The SDK's errors: one `APIError` subclass per gRPC status, with the server's google.rpc
details decoded (`field`, `retry_after_s`, `reason`, `prediction`)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from halfmoon.results import SloPrediction
from halfmoon.v1 import generation_pb2 as pb


class APIError(Exception):
    """A call failed with gRPC status `code` (never OK).

    field: the request field at fault (google.rpc.BadRequest), e.g. "sampling.top_p".
    retry_after_s: how long the server asks to wait before retrying (google.rpc.RetryInfo).
    reason: why a request was rejected (google.rpc.ErrorInfo): admission's reason (ttft, tbt,
        deadline, shed, queue_threshold, queue_full, kv_capacity), too_many_streams, overloaded.
    prediction: what admission predicted for a rejected request (`SloPrediction`), if anything.
    """

    def __init__(self, code: grpc.StatusCode, message: str, *, field: str | None = None,
                 retry_after_s: float | None = None, prediction: SloPrediction | None = None,
                 reason: str | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s
        self.prediction = prediction
        self.reason = reason

    @property
    def rejected(self) -> bool:
        """A rejection: nothing was spent on the request and it may be sent again after
        `retry_after_s` (RESOURCE_EXHAUSTED with a retry hint; a request over a size limit has
        none: sending it again cannot help)."""
        return self.code is grpc.StatusCode.RESOURCE_EXHAUSTED and self.retry_after_s is not None


class InvalidArgumentError(APIError):
    """A request field is invalid (`field` names it)."""


class NotFoundError(APIError):
    """The model (or, unloading, the LoRA adapter) is not served by this endpoint."""


class ResourceExhaustedError(APIError):
    """A rejection (admission: a predicted SLO miss, a full queue, no KV room; or this client's
    stream limit) with `reason` and `retry_after_s`, or a request over a size limit."""


class UnavailableError(APIError):
    """The server cannot be reached or cannot serve now (retried with backoff before raising)."""


class DeadlineExceededError(APIError):
    """The call's deadline passed; the server stopped the work."""


class CancelledError(APIError):
    """The call was cancelled; the server stopped the work."""


class UnauthenticatedError(APIError):
    """Missing or wrong bearer token."""


class PermissionDeniedError(APIError):
    """An admin call on a server whose admin API is off (it has no admin tokens)."""


class FailedPreconditionError(APIError):
    """The call conflicts with the server's state (e.g. other weights are loaded under an
    adapter's name: unload it first)."""


class InternalError(APIError):
    """A bug in the server (or a reply that breaks the protocol)."""


ERRORS: Mapping[grpc.StatusCode, type[APIError]] = MappingProxyType({
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.INTERNAL: InternalError,
})


def api_error(code: grpc.StatusCode, message: str, **details: Any) -> APIError:
    """The `APIError` subclass for `code` (plain `APIError` for codes without one)."""
    return ERRORS.get(code, APIError)(code, message, **details)


def error_from_rpc(error: grpc.RpcError) -> APIError:
    """Decode a failed call (sync or aio), including its google.rpc.Status details."""
    code, message = error.code(), error.details() or ""  # type: ignore[attr-defined]
    try:
        status = rpc_status.from_call(error)
    except ValueError:  # details inconsistent with the status: keep the status alone
        status = None
    details: dict[str, Any] = {}
    for any_detail in status.details if status is not None else ():
        details.update(_decode_detail(any_detail))
    return api_error(code, message, **details)


def _decode_detail(any_detail: Any) -> dict[str, Any]:
    if any_detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
        bad = error_details_pb2.BadRequest()
        any_detail.Unpack(bad)
        return {"field": bad.field_violations[0].field} if bad.field_violations else {}
    if any_detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
        info = error_details_pb2.RetryInfo()
        any_detail.Unpack(info)
        return {"retry_after_s": info.retry_delay.ToTimedelta().total_seconds()}
    if any_detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
        info = error_details_pb2.ErrorInfo()
        any_detail.Unpack(info)
        return {"reason": info.reason or None}
    if any_detail.Is(pb.SloPrediction.DESCRIPTOR):
        p = pb.SloPrediction()
        any_detail.Unpack(p)
        return {"prediction": slo_prediction(p)}
    return {}  # a detail this client does not know: ignored


def slo_prediction(p: pb.SloPrediction) -> SloPrediction:
    return SloPrediction(p.predicted_ttft_ms, p.predicted_tbt_ms, p.ttft_slo_ms, p.tbt_slo_ms)
