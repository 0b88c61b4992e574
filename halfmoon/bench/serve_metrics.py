"""What `halfmoon bench serve` computes from what the client saw: per-request records, TTFT, TBT
(Mooncake's), TPOT, SLO attainment, goodput and the run's summary (definitions in
bench/serve_bench.py's docstring)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one request; times are seconds since the replay started."""

    index: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    sent_s: float | None = None
    token_times: list[float] = field(default_factory=list)  # one entry per token, in order
    done_s: float | None = None
    cached_tokens: int = 0
    status: str = "pending"  # "ok" | "rejected" (RESOURCE_EXHAUSTED) | "error" | "timeout" (cut off)
    code: str | None = None  # the gRPC status name of a rejection or error
    message: str = ""
    prediction: tuple[float, float] | None = None  # the server's (TTFT, TBT) prediction, ms
    server: tuple[float, float, float, float] | None = None  # the server's queue, prefill, transfer, TTFT ms

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.arrival_s if self.token_times else None


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float
    tbt_ms: float


def spread(token_times: Sequence[float], now: float, n: int) -> list[float]:
    """Times to record for a chunk of `n` tokens arriving at `now`: evenly over the gap since
    the previous token (a speculative verification's tokens pace the stream as n gaps of g / n;
    the chunk's last token is at `now`). The first chunk's tokens are all at `now`."""
    if not token_times or n <= 1:
        return [now] * n
    last = token_times[-1]
    return [last + (now - last) * (i + 1) / n for i in range(n)]


def tbt_s(token_times: Sequence[float]) -> float | None:
    """Mooncake's TBT: mean of the longest 10% of the gaps (at least one gap); None without gaps."""
    gaps = np.diff(np.asarray(token_times, dtype=np.float64))
    if gaps.size == 0:
        return None
    k = max(1, gaps.size // 10)
    return float(np.sort(gaps)[-k:].mean())


def tpot_s(token_times: Sequence[float]) -> float | None:
    """Mean time per output token after the first; None for a single token."""
    if len(token_times) < 2:
        return None
    return (token_times[-1] - token_times[0]) / (len(token_times) - 1)


def stats_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 in ms (linear interpolation between samples); None when empty."""
    if not values_s:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    out: dict[str, float | None] = {"mean": round(float(ms.mean()), 3)}
    for q in PERCENTILES:
        out[f"p{q}"] = round(float(np.percentile(ms, q)), 3)
    return out


SERVER_TIMINGS = ("queue", "prefill", "transfer", "ttft")


def server_ms(result: Any) -> tuple[float, float, float, float] | None:
    """The server's own queue / prefill / transfer / TTFT milliseconds from a result's `timings`
    (None when it carries none): where a request's TTFT went, beside what the client measured."""
    t = getattr(result, "timings", None)
    return None if t is None else (t.queue_ms, t.prefill_ms, t.transfer_ms, t.ttft_ms)


def predicted_ms(result: Any) -> tuple[float, float] | None:
    """The server's (predicted TTFT, predicted TBT) in ms from a result's `prediction` (a message,
    dataclass or dict); None when the result has none (an SDK or a server without predictions)."""
    p = getattr(result, "prediction", None)
    if p is None:
        return None
    fields = p if isinstance(p, Mapping) else {k: getattr(p, k, None) for k in ("predicted_ttft_ms",
                                                                              "predicted_tbt_ms")}
    ttft, tbt = fields.get("predicted_ttft_ms"), fields.get("predicted_tbt_ms")
    return None if ttft is None or tbt is None else (float(ttft), float(tbt))


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    """Completed, first token within the TTFT SLO, TBT within the TBT SLO (a one-token output
    has no gaps, so no TBT to miss)."""
    if record.status != "ok" or record.ttft_s is None:
        return False
    tbt = tbt_s(record.token_times)
    return bool(record.ttft_s * 1e3 <= slo.ttft_ms and (tbt is None or tbt * 1e3 <= slo.tbt_ms))


def summarize(records: Sequence[RequestRecord], window_s: float, makespan_s: float, slo: Slo) -> dict[str, Any]:
    """The run's metrics. Goodput is per second of `window_s` (the workload's arrival window)."""
    done = [r for r in records if r.status == "ok"]
    good = sum(1 for r in records if meets_slo(r, slo))
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(len(r.token_times) for r in done)
    window = window_s if window_s > 0 else makespan_s  # a one-request trace has no window
    lags = [r.sent_s - r.arrival_s for r in records if r.sent_s is not None]
    return {
        "requests": len(records), "completed": len(done),
        "rejected": sum(r.status == "rejected" for r in records),
        "errors": sum(r.status == "error" for r in records),
        "errors_by_status": dict(sorted(Counter(r.code for r in records if r.code).items())),
        "short_outputs": sum(len(r.token_times) != r.max_tokens for r in done),
        "ttft_ms": stats_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tbt_ms": stats_ms([t for r in done if (t := tbt_s(r.token_times)) is not None]),
        "tpot_ms": stats_ms([t for r in done if (t := tpot_s(r.token_times)) is not None]),
        "slo_met": good,
        "goodput_rps": good / window if window > 0 else None,
        "slo_attainment_pct": 100.0 * good / len(records) if records else None,
        "prefix_hit_rate": sum(r.cached_tokens for r in done) / prompt if prompt else None,
        "throughput": {"requests_per_s": _per_s(len(done), makespan_s),
                       "output_tokens_per_s": _per_s(output, makespan_s),
                       "prompt_tokens_per_s": _per_s(prompt, makespan_s)},
        "window_s": round(window, 3), "makespan_s": round(makespan_s, 3),
        "max_send_lag_ms": round(max(lags) * 1e3, 3) if lags else None,
    }


def _per_s(count: float, seconds: float) -> float | None:
    return round(count / seconds, 3) if seconds > 0 else None


def request_rows(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """Per-request results for serve_bench.json (ms, rounded)."""
    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1e3, 3)

    return [{"index": r.index, "arrival_s": round(r.arrival_s, 4), "prompt_tokens": r.prompt_tokens,
             "cached_tokens": r.cached_tokens, "max_tokens": r.max_tokens, "tokens": len(r.token_times),
             "status": r.status, "code": r.code, "ttft_ms": ms(r.ttft_s), "tbt_ms": ms(tbt_s(r.token_times)),
             "tpot_ms": ms(tpot_s(r.token_times)), "message": r.message or None,
             "sent_lag_ms": None if r.sent_s is None else ms(r.sent_s - r.arrival_s),
             "server_ms": None if r.server is None else dict(zip(SERVER_TIMINGS, (round(x, 3) for x in r.server),
                                                                 strict=True))} for r in records]
