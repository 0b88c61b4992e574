"""What a client is told about a rejection and about an admitted request's prediction: written
once for both APIs (gRPC details in `grpc_api.py`, OpenAI JSON in `openai_schema.py`).

A rejection (`RetryableRejection`: 429 / RESOURCE_EXHAUSTED, nothing was spent on the request)
carries a reason (admission's, e.g. `ttft`, `queue_full`; see conductor/admission.py), a
Retry-After hint and, when admission predicted anything, the predictions next to the objectives.
"""

from __future__ import annotations

import math
from typing import Any

from halfmoon.conductor.errors import RetryableRejection, TooManyStreamsError
from halfmoon.core.messages import SloPrediction


def reason_of(error: RetryableRejection) -> str:
    """The rejection's machine-readable reason; a rejection raised without one is named by kind."""
    if error.reason:
        return error.reason
    return "too_many_streams" if isinstance(error, TooManyStreamsError) else "overloaded"


def retry_after_header(error: RetryableRejection) -> str:
    """HTTP `Retry-After`: whole seconds, at least 1 (the header has no fractions)."""
    return str(max(1, math.ceil(error.retry_after_s)))


def prediction_json(p: SloPrediction) -> dict[str, float | None]:
    """The prediction as JSON: milliseconds; a prediction that is not finite is null, an
    objective of 0 means none."""
    return {"predicted_ttft_ms": _finite(p.predicted_ttft_ms), "predicted_tbt_ms": _finite(p.predicted_tbt_ms),
            "ttft_slo_ms": p.ttft_slo_ms, "tbt_slo_ms": p.tbt_slo_ms}


def rejection_json(error: RetryableRejection) -> dict[str, Any]:
    """The fields a rejection adds to the OpenAI error object."""
    out: dict[str, Any] = {"reason": reason_of(error), "retry_after_s": error.retry_after_s}
    if error.prediction is not None:
        out["prediction"] = prediction_json(error.prediction)
    return out


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
