"""The pure parts of the admission benchmark (bench/admission_bench.py): the trace scaled and cut
to a window, the calibration search, each replay's admission metrics, the server's index health
scraped from /metrics, and the verdict against issue 18's targets.

Per replay (one policy at one load), from what the client saw:

    goodput          requests meeting both SLOs per second of the window; with --same-requests
                     (the same requests at every load, in window / load seconds), per second of
                     the replay's makespan (first arrival to last answer, drain included): the
                     window would credit a higher load with the drain's 30 s (admission run 8)
    admitted_ok_pct  of the requests the server admitted (not RESOURCE_EXHAUSTED), the share that
                     met both SLOs; a request cut off at the replay's deadline was admitted
    errors_5xx       any status other than RESOURCE_EXHAUSTED (UNAVAILABLE, INTERNAL, ...)
    wasted_prefill   prompt tokens computed for admitted requests that then missed or failed:
                     prompt - cached per such request (a failure has no usage: all its prompt)
    prediction error median |predicted - measured| / measured over the completed requests that
                     carried the server's prediction (TTFT; TBT as Mooncake's, serve_metrics.py)
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import median
from typing import Any

from halfmoon.bench.serve_metrics import RequestRecord, Slo, meets_slo, summarize, tbt_s
from halfmoon.bench.workload import Request, Workload

POLICIES = ("none", "queue-threshold", "early", "predictive")
GOODPUT_OF_BEST_PCT = 90.0  # predictive under overload keeps this share of the best goodput
ADMITTED_OK_PCT = 99.0  # ... and this share of what it admits meets both SLOs
COLLAPSE_OF_BEST_PCT = 50.0  # `none` has collapsed when its goodput falls below this share
OVERLOAD = 2.0  # the loads (multiples of the calibrated rate) the targets are judged at: >= this
HEARTBEAT_GAP = "halfmoon_index_heartbeat_max_gap_seconds"
RESYNCS = "halfmoon_index_resyncs_total"


# ---------------------------------------------------------------------------- workloads


def scaled(workload: Workload, speed: float) -> Workload:
    """The workload `speed` times faster (arrivals and window divided by it)."""
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    requests = tuple(Request(r.arrival_s / speed, r.prompt_ids, r.max_tokens) for r in workload.requests)
    return Workload(f"{workload.name} x{speed:.3g}", requests, workload.duration_s / speed)


def windowed(workload: Workload, window_s: float | None) -> Workload:
    """Only the requests arriving in the first `window_s` seconds (None: all); the window is
    the shorter of `window_s` and the workload's own."""
    if window_s is None or window_s >= workload.duration_s:
        return workload
    requests = tuple(r for r in workload.requests if r.arrival_s <= window_s)
    return Workload(f"{workload.name}, first {window_s:g} s", requests, window_s)


def trace_rate(workload: Workload) -> float:
    """The trace's mean arrival rate at speed 1 (req/s): requests over the span of arrivals."""
    return len(workload.requests) / workload.duration_s if workload.duration_s > 0 else 0.0


def offered_rps(workload: Workload) -> float | None:
    """What a replay offers: its requests per second of its window."""
    return len(workload.requests) / workload.duration_s if workload.duration_s > 0 else None


# ---------------------------------------------------------------------------- calibration


@dataclass(frozen=True, slots=True)
class Calibration:
    """The search's answer: `speed`, the fastest probe that met the attainment target (None:
    none did), `failed_at` the slowest probe that missed it, and every probe's attainment."""

    speed: float | None
    failed_at: float | None
    probes: tuple[tuple[float, float], ...]  # (speed, SLO attainment %) in probing order

    def to_json(self, rate_at_1x: float) -> dict[str, Any]:
        def rate(s: float | None) -> float | None:
            return None if s is None else round(s * rate_at_1x, 4)

        return {"speed": self.speed, "rate_rps": rate(self.speed), "failed_at_speed": self.failed_at,
                "probes": [{"speed": round(s, 4), "rate_rps": rate(s), "slo_attainment_pct": round(a, 2)}
                           for s, a in self.probes]}


def search_speed(attainment: Callable[[float], float], start: float, target_pct: float,
                 max_probes: int, resolution: float = 1.1) -> Calibration:
    """The largest speed whose attainment (% of requests meeting both SLOs) is >= `target_pct`,
    in at most `max_probes` calls: double (or halve) from `start` until one probe meets the
    target and one misses, then bisect geometrically until the two are within `resolution`x."""
    if not start > 0 or max_probes < 1:
        raise ValueError(f"need start > 0 and max_probes >= 1, got {start}, {max_probes}")
    probes: list[tuple[float, float]] = []
    good: float | None = None
    bad: float | None = None

    def probe(speed: float) -> None:
        nonlocal good, bad
        pct = attainment(speed)
        probes.append((speed, pct))
        if pct >= target_pct:
            good = speed if good is None else max(good, speed)
        else:
            bad = speed if bad is None else min(bad, speed)

    speed = start
    while len(probes) < max_probes and (good is None or bad is None):
        probe(speed)
        speed = speed * 2 if bad is None else speed / 2
    while len(probes) < max_probes and good is not None and bad is not None and bad / good > resolution:
        probe(math.sqrt(good * bad))
    return Calibration(good, bad, tuple(probes))


# ---------------------------------------------------------------------------- one replay


def admitted(record: RequestRecord) -> bool:
    return record.status != "rejected"


def wasted_prefill_tokens(records: Sequence[RequestRecord], slo: Slo) -> int:
    """Prompt tokens computed (not cached) for admitted requests that missed an SLO or failed."""
    return sum(r.prompt_tokens - r.cached_tokens for r in records if admitted(r) and not meets_slo(r, slo))


def admitted_ok_pct(records: Sequence[RequestRecord], slo: Slo) -> float | None:
    """Of the admitted requests, the % meeting both SLOs (None: nothing admitted)."""
    taken = [r for r in records if admitted(r)]
    return 100.0 * sum(meets_slo(r, slo) for r in taken) / len(taken) if taken else None


def prediction_errors(records: Sequence[RequestRecord]) -> tuple[list[float], list[float]]:
    """Relative errors |predicted - measured| / measured of TTFT and of TBT, over completed
    requests with a prediction (a measured 0, or a single token's missing TBT, is skipped)."""
    ttft, tbt = [], []
    for r in records:
        if r.status != "ok" or r.prediction is None or r.ttft_s is None:
            continue
        predicted_ttft, predicted_tbt = r.prediction
        _relative(ttft, predicted_ttft, r.ttft_s * 1e3)
        measured_tbt = tbt_s(r.token_times)
        if measured_tbt is not None:
            _relative(tbt, predicted_tbt, measured_tbt * 1e3)
    return ttft, tbt


def _relative(into: list[float], predicted: float, measured: float) -> None:
    if measured > 0:
        into.append(abs(predicted - measured) / measured)


def _median_pct(errors: list[float]) -> float | None:
    return round(100.0 * median(errors), 2) if errors else None


def run_metrics(records: Sequence[RequestRecord], window_s: float, makespan_s: float,
                slo: Slo) -> dict[str, Any]:
    """serve_metrics' summary of the replay plus the admission figures (module doc)."""
    base = summarize(records, window_s, makespan_s, slo)
    ttft_errors, tbt_errors = prediction_errors(records)
    return {**base,
            "offered_rps": round(len(records) / window_s, 4) if window_s > 0 else None,
            "goodput_makespan_rps": round(base["slo_met"] / makespan_s, 4) if makespan_s > 0 else None,
            "admitted": sum(admitted(r) for r in records),
            "admitted_ok_pct": admitted_ok_pct(records, slo),
            "errors_5xx": base["errors"],
            "timed_out": sum(r.status == "timeout" for r in records),
            "wasted_prefill_tokens": wasted_prefill_tokens(records, slo),
            "predictions": len(ttft_errors),
            "ttft_prediction_error_pct": _median_pct(ttft_errors),
            "tbt_prediction_error_pct": _median_pct(tbt_errors)}


# ---------------------------------------------------------------------------- /metrics

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def index_health(text: str) -> dict[str, float | None]:
    """The index heartbeat's health from a Prometheus text page: the largest max-gap and the
    sum of resyncs over their series; None for a metric the page does not have."""
    values: dict[str, list[float]] = {HEARTBEAT_GAP: [], RESYNCS: []}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) in values:
            values[match.group(1)].append(float(match.group(3)))
    gaps, resyncs = values[HEARTBEAT_GAP], values[RESYNCS]
    return {"heartbeat_max_gap_s": max(gaps) if gaps else None, "resyncs": sum(resyncs) if resyncs else None}


# ---------------------------------------------------------------------------- verdict


@dataclass(frozen=True, slots=True)
class Verdict:
    """A mode's result against the targets: None where the policy needed was not run, or where
    no run met both SLOs (no best goodput to take a share of)."""

    predictive_met: bool | None
    none_collapsed: bool | None
    reasons: tuple[str, ...]  # what missed, one line each

    def to_json(self) -> dict[str, Any]:
        return {"predictive_met": self.predictive_met, "none_collapsed": self.none_collapsed,
                "reasons": list(self.reasons)}


def goodput(run: dict[str, Any]) -> float | None:
    """The run's goodput on its basis (module docstring): "window" unless the run says "makespan"."""
    m = run["metrics"]
    return m["goodput_makespan_rps"] if run.get("goodput_basis") == "makespan" else m["goodput_rps"]


def best_goodput(runs: Sequence[dict[str, Any]]) -> float:
    """The best goodput any run (of one mode) achieved, at any policy and load."""
    return max((goodput(run) or 0.0 for run in runs), default=0.0)


def pct_of_best(goodput: float | None, best: float) -> float | None:
    return None if goodput is None or best <= 0 else 100.0 * goodput / best


def verdict(runs: Sequence[dict[str, Any]]) -> Verdict:
    """Issue 18's targets for one mode: `predictive` at every load >= OVERLOAD x keeps >= 90% of
    the best goodput, >= 99% of what it admits meets both SLOs, no 5xx; `none` collapses (its
    goodput at the highest load under 50% of the best)."""
    best = best_goodput(runs)
    if best <= 0:  # nothing met both SLOs anywhere: no share of the best to judge
        return Verdict(None, None, ("no run met both SLOs (best goodput 0): a lower --base-speed or "
                                    "--start-speed, or looser SLOs",))
    reasons: list[str] = []
    overload = [r for r in runs if r["policy"] == "predictive" and r["load"] >= OVERLOAD]
    for run in overload:
        reasons += _misses(run, best)
    predictive_met = (not reasons) if overload else None
    plain = sorted((r for r in runs if r["policy"] == "none"), key=lambda r: r["load"])
    none_collapsed = None
    if plain:
        share = pct_of_best(goodput(plain[-1]), best)
        none_collapsed = share is not None and share < COLLAPSE_OF_BEST_PCT
        if not none_collapsed:
            reasons.append(f"none at {plain[-1]['load']:g}x kept {_pct(share)} of the best goodput "
                           f"(collapse: < {COLLAPSE_OF_BEST_PCT:g}%)")
    return Verdict(predictive_met, none_collapsed, tuple(reasons))


def _misses(run: dict[str, Any], best: float) -> list[str]:
    m, at = run["metrics"], f"predictive at {run['load']:g}x"
    share = pct_of_best(goodput(run), best)
    misses = []
    if share is None or share < GOODPUT_OF_BEST_PCT:
        misses.append(f"{at}: goodput {_pct(share)} of the best (target >= {GOODPUT_OF_BEST_PCT:g}%)")
    ok = m["admitted_ok_pct"]
    if ok is None or ok < ADMITTED_OK_PCT:
        misses.append(f"{at}: {_pct(ok)} of admitted met both SLOs (target >= {ADMITTED_OK_PCT:g}%)")
    if m["errors_5xx"]:
        misses.append(f"{at}: {m['errors_5xx']} 5xx-equivalent errors (target 0)")
    return misses


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}%"
