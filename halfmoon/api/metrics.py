"""Prometheus metrics of the front door (`/metrics`), in Prometheus' naming conventions:
`halfmoon_` prefix, base units in the name (`_seconds`), `_total` on counters."""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from halfmoon.conductor.adapters import LoraStats
from halfmoon.conductor.admission_stats import AdmissionStats
from halfmoon.conductor.backend import BackendStats, WorkerView
from halfmoon.conductor.planner import MODES, Action
from halfmoon.conductor.planner_loop import PlannerSnapshot
from halfmoon.core.params import FEATURES, SamplingParams
from halfmoon.core.messages import RequestEnd

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
        yield CounterMetricFamily("halfmoon_requests_reprefilled_tokens", "Prompt tokens sent to prefill again by "
                                  "re-runs and moves (a moved request's prompt is its prompt + the tokens "
                                  "already sent; the prefix cache spares most of their compute).",
                                  s.tokens_reprefilled)
        depth = GaugeMetricFamily("halfmoon_queue_depth", "Requests pending on each worker (prefill: sent "
                                  "and not prefilled; decode: bound to it).", labels=["worker"])
        for worker, n in sorted(s.queue_depth.items()):
            depth.add_metric([worker], n)
        yield depth
        if s.admission is not None:
            yield from _admission_metrics(s.admission)
        if s.index_health:
            yield from _index_metrics(s.index_health)
        if s.workers:
            yield from _worker_metrics(s.workers)
        if s.lora is not None:
            yield from _lora_metrics(s.lora, s.workers)
        if s.planner is not None:
            yield from _planner_metrics(s.planner)
        if s.index_up is not None:
            yield GaugeMetricFamily("halfmoon_index_up", "1 while the Conductor's cluster index reaches its Redis, "
                                    "0 while it serves from local caches only.", float(s.index_up))
            yield CounterMetricFamily("halfmoon_index_redis_errors", "Failed Redis calls of the Conductor's "
                                      "cluster index (each one, not once per outage).", s.index_errors)


def _worker_metrics(workers: tuple[WorkerView, ...]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Per worker, from its last health answer: liveness, batch, steps, KV blocks by tier and state,
    KV bytes received, prompt tokens computed / cached, prefix blocks by the tier they came from."""
    up = GaugeMetricFamily("halfmoon_worker_up", "1 while the worker answers its health checks.",
                           labels=["worker", "role"])
    restarts = CounterMetricFamily("halfmoon_worker_restarts", "Times the worker was restarted.", labels=["worker"])
    running = GaugeMetricFamily("halfmoon_worker_running", "Requests in the worker's running batch.",
                                labels=["worker"])
    steps = CounterMetricFamily("halfmoon_worker_steps", "Engine steps the worker ran.", labels=["worker"])
    blocks = GaugeMetricFamily("halfmoon_worker_kv_blocks", "KV blocks of the worker by tier (device, host, disk) "
                               "and state (used, free; reserved: device blocks held for KV on its way).",
                               labels=["worker", "tier", "state"])
    received = CounterMetricFamily("halfmoon_worker_kv_received_bytes", "KV bytes the (decode) worker received "
                                   "and verified.", labels=["worker"])
    by_path = CounterMetricFamily("halfmoon_worker_kv_received_path_bytes", "KV bytes the (decode) worker "
                                  "received and verified, by the senders' path (host: from their KV pages; "
                                  "staged: through pinned slots, KV on a GPU).", labels=["worker", "path"])
    prompt = CounterMetricFamily("halfmoon_worker_prompt_tokens", "Prompt tokens the worker computed or found "
                                 "cached.", labels=["worker", "source"])
    prefix = CounterMetricFamily("halfmoon_worker_prefix_blocks", "Prefix blocks the worker reused from below "
                                 "its device pool, by tier (host, disk, remote = another worker's).",
                                 labels=["worker", "tier"])
    served = CounterMetricFamily("halfmoon_worker_blocks_served", "KV blocks the worker's block server sent "
                                 "to other workers (their remote prefix hits).", labels=["worker"])
    fetching = GaugeMetricFamily("halfmoon_worker_fetches_in_flight", "Remote prefix pulls the worker is "
                                 "waiting on now (their requests are in the fetching state).", labels=["worker"])
    fetch_failed = CounterMetricFamily("halfmoon_worker_fetch_failures", "Remote prefix pulls that failed (holder "
                                       "gone, timeout, corrupt block): their prefixes were recomputed.",
                                       labels=["worker"])
    spec = CounterMetricFamily("halfmoon_worker_speculative_tokens", "Speculative decoding: draft tokens "
                               "proposed and accepted, and tokens the verifications emitted (accepted + one "
                               "each); acceptance = accepted / proposed.", labels=["worker", "kind"])
    verifications = CounterMetricFamily("halfmoon_worker_speculative_verifications", "Speculative "
                                        "verifications (a request's step with drafts); tokens per "
                                        "verification = emitted / this.", labels=["worker"])
    for w in workers:
        up.add_metric([w.worker_id, w.role], float(w.alive))
        restarts.add_metric([w.worker_id], w.restarts)
        load = w.load
        if load is None:
            continue
        running.add_metric([w.worker_id], load.running)
        steps.add_metric([w.worker_id], load.steps)
        used = load.total_blocks - load.free_blocks
        for tier, state, n in (("device", "used", used), ("device", "free", load.free_blocks),
                               ("device", "reserved", load.reserved_blocks),
                               ("host", "used", load.host_blocks_used),
                               ("host", "free", load.host_blocks_total - load.host_blocks_used),
                               ("disk", "used", load.disk_blocks_used),
                               ("disk", "free", load.disk_blocks_total - load.disk_blocks_used)):
            blocks.add_metric([w.worker_id, tier, state], n)
        received.add_metric([w.worker_id], load.kv_bytes_received)
        by_path.add_metric([w.worker_id, "host"], load.kv_bytes_received - load.kv_bytes_staged)
        by_path.add_metric([w.worker_id, "staged"], load.kv_bytes_staged)
        served.add_metric([w.worker_id], load.blocks_served_remote)
        fetching.add_metric([w.worker_id], load.fetches_in_flight)
        fetch_failed.add_metric([w.worker_id], load.fetch_failures)
        prompt.add_metric([w.worker_id, "computed"], load.prompt_tokens_computed)
        prompt.add_metric([w.worker_id, "cached"], load.prompt_tokens_cached)
        for tier, n in (("host", load.blocks_from_host), ("disk", load.blocks_from_disk),
                        ("remote", load.blocks_fetched_remote)):
            prefix.add_metric([w.worker_id, tier], n)
        for kind, n in (("proposed", load.spec_proposed), ("accepted", load.spec_accepted),
                        ("emitted", load.spec_emitted)):
            spec.add_metric([w.worker_id, kind], n)
        verifications.add_metric([w.worker_id], load.spec_verifications)
    yield from (up, restarts, running, steps, blocks, received, by_path, prompt, prefix, served, fetching, fetch_failed,
                spec, verifications, _standby_metric(workers))


def _lora_metrics(lora: LoraStats, workers: tuple[WorkerView, ...]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """LoRA adapters: served, requests per adapter, registry loads/unloads, and each worker's
    slot pool (folders read, page-ins, evictions, steps that found their adapter resident)."""
    yield GaugeMetricFamily("halfmoon_lora_adapters_loaded", "LoRA adapters a request may name now.",
                            len(lora.loaded))
    requests = CounterMetricFamily("halfmoon_lora_requests", "Requests per LoRA adapter (model name) since "
                                   "start.", labels=["adapter"])
    for name, n in lora.requests:
        requests.add_metric([name], n)
    yield requests
    changes = CounterMetricFamily("halfmoon_lora_registry_changes", "Adapters loaded and unloaded through "
                                  "--lora and the admin API.", labels=["change"])
    changes.add_metric(["load"], lora.loads)
    changes.add_metric(["unload"], lora.unloads)
    yield changes
    events = CounterMetricFamily("halfmoon_lora_slot_events", "Each worker's LoRA slots: disk_load (a folder "
                                 "read), page_in (copied into a slot), eviction, hit (a step found it "
                                 "resident); hit rate = hit / (hit + page_in).", labels=["worker", "event"])
    for w in workers:
        c = w.load.lora if w.load is not None else None
        if c is None:
            continue
        for event, n in (("disk_load", c.disk_loads), ("page_in", c.page_ins), ("eviction", c.evictions),
                         ("hit", c.hits)):
            events.add_metric([w.worker_id, event], n)
    yield events


def _planner_metrics(p: PlannerSnapshot) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The planner (conductor/planner_loop.py): its mode, the split serving now and the one it
    wants (`desired_workers`: what a Kubernetes autoscaler reads, Helm `planner.autoscaler`), its
    decisions by action, the moves that failed and the last decision's predicted gain."""
    mode = GaugeMetricFamily("halfmoon_planner_mode", "1 for the planner's mode (off, advise: decisions shown, "
                             "nothing changes; act: the Conductor applies them), 0 for the others.",
                             labels=["mode"])
    for name in MODES:
        mode.add_metric([name], float(p.mode == name))
    yield mode
    now = GaugeMetricFamily("halfmoon_planner_workers", "Workers serving each role now (a draining one not "
                            "counted).", labels=["role"])
    desired = GaugeMetricFamily("halfmoon_planner_desired_workers", "Workers the planner wants in each role: "
                                "the target of its last decision (the split now when it holds).", labels=["role"])
    for role in ("prefill", "decode"):
        now.add_metric([role], getattr(p.split, role))
        desired.add_metric([role], getattr(p.desired, role))
    yield from (now, desired)
    decisions = CounterMetricFamily("halfmoon_planner_decisions", "The planner's decisions by action (hold, "
                                    "flip, add, remove, rollback), applied (act) or only advised.",
                                    labels=["action"])
    for action in typing.get_args(Action):  # every action's series exists, at zero until it happens
        decisions.add_metric([action], p.counts.get(action, 0))
    yield decisions
    yield CounterMetricFamily("halfmoon_planner_moves_failed", "Moves the Conductor could not apply (the split "
                              "stayed; the timeline says why).", p.failed)
    last = p.decisions[-1].gain if p.decisions else 0.0
    yield GaugeMetricFamily("halfmoon_planner_last_gain", "Predicted goodput gain (relative: 0.1 = 10%) of the "
                            "planner's last decision toward its target (0 before the first).", last)
    yield GaugeMetricFamily("halfmoon_planner_busy", "1 while the planner applies a move (a worker drains).",
                            float(p.busy))


def _standby_metric(workers: tuple[WorkerView, ...]) -> GaugeMetricFamily:
    """Spare workers per role and state: standby (warmed, ready to be promoted) and warming (a
    dead worker's restart, on its way to becoming the next standby); 0 without `--standby`."""
    gauge = GaugeMetricFamily("halfmoon_standby_workers", "Warm standby workers per role: standby = ready to "
                              "take a dead worker's place, warming = being restarted and warmed up.",
                              labels=["role", "state"])
    roles = sorted({w.role for w in workers if w.role in ("prefill", "decode")})
    for role in roles:
        for state in ("standby", "warming"):
            gauge.add_metric([role, state], sum(w.role == role and w.state == state for w in workers))
    return gauge


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
        self.slo = Counter("halfmoon_requests_slo", "Finished requests by priority class and whether they met "
                           "both their objectives (outcome met / missed): goodput is the rate of met.",
                           ["class", "outcome"], registry=r)
        # Labels: the request's priority class and the worker that set the figure (TTFT and queue:
        # its prefill worker; TPOT and e2e: its decode worker; "engine" co-located).
        cls = ["class", "worker"]
        self.ttft = Histogram("halfmoon_time_to_first_token_seconds", "Time to first token, by priority class "
                              "and prefill worker.", cls, buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("halfmoon_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request, by priority class and "
                              "decode worker.", cls, buckets=_TOKEN_GAP_BUCKETS, registry=r)
        self.e2e = Histogram("halfmoon_request_duration_seconds", "Arrival to last token, by priority class and "
                             "decode worker.", cls, buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("halfmoon_request_queue_seconds", "Arrival to admission into a batch, by priority "
                               "class and prefill worker.", cls, buckets=_LATENCY_BUCKETS, registry=r)
        self.features = Counter("halfmoon_request_features", "Finished requests by the sampling feature they used "
                                "(logprobs, logit_bias, penalties, min_tokens; a request may count under several).",
                                ["feature"], registry=r)
        for feature in FEATURES:  # every series exists from the start, at zero
            self.features.labels(feature)
        self._seen: set[tuple[str, str]] = set()
        r.register(_BackendCollector(stats))

    def used(self, params: SamplingParams) -> None:
        """A finished request's sampling features."""
        for feature in params.features():
            self.features.labels(feature).inc()

    def finished(self, api: str, end: RequestEnd, priority_class: str = "standard",
                 trace_id: str | None = None, met: bool = True) -> None:
        """A request's last chunk. `trace_id`: its trace, attached to its latency samples as an
        exemplar (OpenMetrics scrapes show it: Grafana jumps from a slow bucket to the trace)."""
        u, t = end.usage, end.timings
        self.requests.labels(api, "ok").inc()
        self.prompt_tokens.inc(u.prompt_tokens)
        self.cached_prompt_tokens.inc(u.cached_prompt_tokens)
        self.generation_tokens.inc(u.completion_tokens)
        prefill, decode = end.prefill_worker or "unknown", end.decode_worker or "unknown"
        self._initialise(priority_class, decode)
        self.slo.labels(priority_class, "met" if met else "missed").inc()
        ex = {"trace_id": trace_id} if trace_id else None
        self.ttft.labels(priority_class, prefill).observe(t.ttft_ms / 1e3, ex)
        self.queue.labels(priority_class, prefill).observe(t.queue_ms / 1e3, ex)
        self.e2e.labels(priority_class, decode).observe(t.e2e_ms / 1e3, ex)
        if u.completion_tokens > 1:
            self.tpot.labels(priority_class, decode).observe(t.mean_tpot_ms / 1e3, ex)

    def _initialise(self, priority_class: str, decode: str) -> None:
        """A worker's first request: its TPOT series exists (at zero) even if that request made
        one token, so a dashboard's rate() over it starts at once."""
        if (priority_class, decode) not in self._seen:
            self._seen.add((priority_class, decode))
            self.tpot.labels(priority_class, decode)

    def failed(self, api: str, code: str) -> None:
        self.requests.labels(api, code.lower()).inc()

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The scrape and its content type: OpenMetrics (with exemplars) when the scraper asks
        for it (`Accept: application/openmetrics-text`, as Prometheus does with exemplar storage
        on), else Prometheus' text format."""
        if accept and "application/openmetrics-text" in accept:
            from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS
            from prometheus_client.openmetrics.exposition import generate_latest as openmetrics

            return openmetrics(self.registry), OPENMETRICS
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
