"""What the Conductor's spans say about a request's admission and routing (core/tracing.py).

    halfmoon.admission   prefix lookup + route + admission decision (both backends)
    halfmoon.reserve     the decode worker's KV reservation (cluster)
        halfmoon.admission.policy / .decision (admit | reject) / .reason
        halfmoon.predicted_ttft_ms / _tbt_ms, halfmoon.ttft_slo_ms / _tbt_slo_ms
        halfmoon.prefill_worker / .decode_worker, halfmoon.prefix_tokens, halfmoon.priority_class
"""

from __future__ import annotations

from halfmoon.conductor.dispatch import Booking
from halfmoon.conductor.errors import RetryableRejection
from halfmoon.core.messages import SloPrediction
from halfmoon.core.tracing import Attributes, Span, Tracer, now_ns

ADMISSION_SPAN = "halfmoon.admission"
RESERVE_SPAN = "halfmoon.reserve"


def admission(tracer: Tracer, parent: Span, start_ns: int, policy: str,
              outcome: Booking | RetryableRejection) -> None:
    """The admission span, ending now (nothing built when `parent` is not recording)."""
    if parent.recording:
        attributes = admitted(policy, outcome) if isinstance(outcome, Booking) else rejected(policy, outcome)
        tracer.record(ADMISSION_SPAN, parent, start_ns, now_ns(), attributes)


def reserve(tracer: Tracer, parent: Span, start_ns: int, decode_worker: str, blocks: int) -> None:
    """The decode worker's KV reservation (an RPC), ending now."""
    if parent.recording:
        tracer.record(RESERVE_SPAN, parent, start_ns, now_ns(),
                      {"halfmoon.decode_worker": decode_worker, "halfmoon.kv_blocks": blocks})


def admitted(policy: str, booking: Booking) -> Attributes:
    """An admitted request: the decision, its predictions and where it runs."""
    return {"halfmoon.admission.policy": policy, "halfmoon.admission.decision": "admit",
            "halfmoon.priority_class": booking.objective.slo_class.name,
            "halfmoon.prefill_worker": booking.prefill_id, "halfmoon.decode_worker": booking.decode_id,
            "halfmoon.prefix_tokens": booking.prefix_tokens, **_predicted(booking.decision.prediction)}


def rejected(policy: str, error: RetryableRejection) -> Attributes:
    """A rejected request: the reason and, where admission predicted, what it predicted."""
    out: dict = {"halfmoon.admission.policy": policy, "halfmoon.admission.decision": "reject",
                 "halfmoon.admission.reason": error.reason, "halfmoon.retry_after_s": error.retry_after_s}
    if error.prediction is not None:
        out |= _predicted(error.prediction)
    return out


def _predicted(p: SloPrediction) -> Attributes:
    return {"halfmoon.predicted_ttft_ms": p.predicted_ttft_ms, "halfmoon.predicted_tbt_ms": p.predicted_tbt_ms,
            "halfmoon.ttft_slo_ms": p.ttft_slo_ms, "halfmoon.tbt_slo_ms": p.tbt_slo_ms}
