"""Prometheus metrics of the front door (`/metrics`), in Prometheus' naming conventions:
`halfmoon_` prefix, base units in the name (`_seconds`), `_total` on counters."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from conductor.admission_stats import AdmissionStats
from conductor.backend import BackendStats
from core.messages import RequestEnd

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RERUN_REASONS = ("worker_lost", "kv_transfer", "migrated")
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _BackendCollector(Collector):
    """Gauges read from the backend at scrape time."""

    def __init__(self, stats: Callable[[], BackendStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self._stats()
        yield GaugeMetricFamily("halfmoon_requests_running", "Requests generating tokens.", s.requests_running)
        yield GaugeMetricFamily("halfmoon_requests_waiting", "Requests waiting for their first token.",
                                s.requests_waiting)
        yield GaugeMetricFamily("halfmoon_kv_cache_blocks_free", "Free KV cache blocks.", s.kv_blocks_free)
        yield GaugeMetricFamily("halfmoon_kv_cache_blocks", "KV cache blocks in total.", s.kv_blocks_total)
        used = 1.0 - s.kv_blocks_free / s.kv_blocks_total if s.kv_blocks_total else 0.0
        yield GaugeMetricFamily("halfmoon_kv_cache_usage_ratio", "Fraction of KV cache blocks in use.", used)
        rerun = CounterMetricFamily("halfmoon_requests_rerun", "Requests re-run on other workers: before their "
                                    "first token by cause (worker_lost, kv_transfer), after it (migrated: "
                                    "moved mid-stream, the client saw a pause).", labels=["reason"])
        for reason in RERUN_REASONS:
            rerun.add_metric([reason], s.requests_rerun.get(reason, 0))
        yield rerun
        depth = GaugeMetricFamily("halfmoon_queue_depth", "Requests pending on each worker (prefill: sent "
                                  "and not prefilled; decode: bound to it).", labels=["worker"])
        for worker, n in sorted(s.queue_depth.items()):
            depth.add_metric([worker], n)
        yield depth
        if s.admission is not None:
            yield from _admission_metrics(s.admission)
        if s.index_health:
            yield from _index_metrics(s.index_health)
        if s.index_up is not None:
            yield GaugeMetricFamily("halfmoon_index_up", "1 while the Conductor's cluster index reaches its Redis, "
                                    "0 while it serves from local caches only.", float(s.index_up))
            yield CounterMetricFamily("halfmoon_index_redis_errors", "Failed Redis calls of the Conductor's "
                                      "cluster index (each one, not once per outage).", s.index_errors)


def _index_metrics(health: Mapping[str, tuple[float, int]]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    gap = GaugeMetricFamily("halfmoon_index_heartbeat_max_gap_seconds", "Longest gap between two cluster-index "
                            "heartbeats of each holder (it expires after the heartbeat TTL).", labels=["holder"])
    resyncs = CounterMetricFamily("halfmoon_index_resyncs", "Times the index had lost a holder (expired "
                                  "heartbeat or Redis restart) and it re-registered.", labels=["holder"])
    for holder, (max_gap, n) in sorted(health.items()):
        gap.add_metric([holder], max_gap)
        resyncs.add_metric([holder], n)
    yield gap
    yield resyncs


def _admission_metrics(a: AdmissionStats) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
    decisions = CounterMetricFamily("halfmoon_admission_decisions", "Admission decisions by priority class, "
                                    "outcome (admitted, rejected) and reason of a rejection.",
                                    labels=["class", "outcome", "reason"])
    for (cls, outcome, reason), n in sorted(a.decisions.items()):
        decisions.add_metric([cls, outcome, reason], n)
    yield decisions
    for name, hist in (("ttft", a.ttft_error), ("tbt", a.tbt_error)):
        family = HistogramMetricFamily(f"halfmoon_prediction_error_{name}_seconds",
                                       f"Predicted minus measured {name.upper()} of admitted requests.")
        buckets = [(_bound(b), n) for b, n in hist.cumulative()] + [("+Inf", hist.count)]
        family.add_metric([], buckets, hist.total)
        yield family


def _bound(value: float) -> str:
    return repr(float(value))


class Metrics:
    """Counters and histograms the front door updates; one registry per server."""

    def __init__(self, stats: Callable[[], BackendStats]) -> None:
        disable_created_metrics()  # no `_created` series: Prometheus' text format does not need them
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("halfmoon_requests", "Finished requests by API and outcome.",
                                ["api", "code"], registry=r)
        self.prompt_tokens = Counter("halfmoon_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.cached_prompt_tokens = Counter("halfmoon_cached_prompt_tokens",
                                            "Prompt tokens served from the KV cache.", registry=r)
        self.generation_tokens = Counter("halfmoon_generation_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram("halfmoon_time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("halfmoon_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              buckets=_TOKEN_GAP_BUCKETS, registry=r)
        self.e2e = Histogram("halfmoon_request_duration_seconds", "Arrival to last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("halfmoon_request_queue_seconds", "Arrival to admission into a batch.",
                               buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_BackendCollector(stats))

    def finished(self, api: str, end: RequestEnd) -> None:
        u, t = end.usage, end.timings
        self.requests.labels(api, "ok").inc()
        self.prompt_tokens.inc(u.prompt_tokens)
        self.cached_prompt_tokens.inc(u.cached_prompt_tokens)
        self.generation_tokens.inc(u.completion_tokens)
        self.ttft.observe(t.ttft_ms / 1e3)
        self.queue.observe(t.queue_ms / 1e3)
        self.e2e.observe(t.e2e_ms / 1e3)
        if u.completion_tokens > 1:
            self.tpot.observe(t.mean_tpot_ms / 1e3)

    def failed(self, api: str, code: str) -> None:
        self.requests.labels(api, code.lower()).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
