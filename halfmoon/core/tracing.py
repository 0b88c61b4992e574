"""Distributed tracing: one OpenTelemetry trace per request, across the Conductor and the workers.

```
client traceparent ─► front door span (Conductor, SERVER) ──┬─ halfmoon.admission, halfmoon.reserve
                                                           ├─ prefill (prefill worker) ─ queue, compute, kv_push
                                                           │     └─ kv_transfer (decode worker; per-layer events)
                                                           └─ decode (decode worker) ─ kv_wait, queue, compute
```

A span crosses a process seam as its W3C `traceparent` string, carried by the typed messages
(`PrefillTask.traceparent`, `DecodeTask.traceparent`) and by the KV transport's DONE message.
Each process builds one `Tracer` from the same resolved `TracingConfig` (the Conductor resolves
the OTEL_* environment once, `TracingConfig.resolve`, and hands the result to every worker in
its `WorkerSpec`), with its role and worker id as resource attributes.

Tracing is off by default. Off, the tracer is `NO_TRACER`: no SDK import, no exporter, and every
span is `NO_SPAN`, whose verbs do nothing. Workers never start a trace of their own: a task
without a traceparent (tracing off, or not sampled at the Conductor) gets `NO_SPAN`, so a
sampled-out request costs the workers nothing. Spans are passed explicitly, never through the
ambient OpenTelemetry context: a request's work hops between tasks, threads and processes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from halfmoon.core.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

TRACEPARENT = "traceparent"
PROTOCOLS = ("grpc", "http/protobuf")
SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on",
            "parentbased_always_off", "parentbased_traceidratio")
DEFAULT_ENDPOINT = {"grpc": "http://localhost:4317", "http/protobuf": "http://localhost:4318/v1/traces"}
DEFAULT_SERVICE = "halfmoon"
ROLES = ("conductor", "prefill", "decode", "colocated")
Attributes = Mapping[str, str | bool | int | float | list[str] | list[int] | list[float]]


class TracingError(ConfigError):
    """Tracing was asked for and cannot run (a missing exporter package, a bad endpoint)."""


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """OpenTelemetry tracing (docs/OPERATIONS.md, "Tracing"). Unset fields come from the standard
    OTEL_* environment variables of the Conductor (`resolve`), else the OpenTelemetry defaults.

    tracing: export one trace per request over OTLP (off by default).
    otlp_endpoint: the collector (default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else
        OTEL_EXPORTER_OTLP_ENDPOINT, else http://localhost:4317); http:// = no TLS.
    otlp_protocol: `grpc` (default: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else
        OTEL_EXPORTER_OTLP_PROTOCOL, else grpc) or `http/protobuf` (needs
        opentelemetry-exporter-otlp-proto-http installed).
    otel_service_name: the resource's service.name (default: OTEL_SERVICE_NAME, else halfmoon).
    trace_sampler: an OTEL_TRACES_SAMPLER name (default: that variable, else
        parentbased_always_on: a client's sampled traceparent is always traced).
    trace_sample_ratio: the ratio of the *traceidratio samplers (default: OTEL_TRACES_SAMPLER_ARG,
        else 1.0).
    otel_resource_attributes: extra resource attributes, `key=value,key=value` (added to
        OTEL_RESOURCE_ATTRIBUTES).
    """

    tracing: bool = False
    otlp_endpoint: str | None = None
    otlp_protocol: str | None = None
    otel_service_name: str | None = None
    trace_sampler: str | None = None
    trace_sample_ratio: float | None = None
    otel_resource_attributes: str | None = None

    def __post_init__(self) -> None:
        if self.otlp_protocol is not None and self.otlp_protocol not in PROTOCOLS:
            raise ConfigError(f"otlp_protocol {self.otlp_protocol!r}: choose one of {', '.join(PROTOCOLS)}")
        if self.trace_sampler is not None and self.trace_sampler not in SAMPLERS:
            raise ConfigError(f"trace_sampler {self.trace_sampler!r}: choose one of {', '.join(SAMPLERS)}")
        if self.trace_sample_ratio is not None and not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise ConfigError(f"trace_sample_ratio must be in [0, 1], got {self.trace_sample_ratio}")
        if self.otel_resource_attributes is not None:
            parse_attributes(self.otel_resource_attributes, "otel_resource_attributes")

    def resolve(self, environ: Mapping[str, str]) -> TracingConfig:
        """Every unset field from `environ`'s OTEL_* variables, else its default: the config
        each process of the cluster then uses as it is (workers may run on other nodes)."""
        if not self.tracing:
            return self
        protocol = self.otlp_protocol or _env(environ, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                                              "OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
        endpoint = self.otlp_endpoint or _env(environ, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if endpoint is None and (base := _env(environ, "OTEL_EXPORTER_OTLP_ENDPOINT")) is not None:
            # The spec: the signal's path is appended to the base endpoint for OTLP/HTTP only.
            endpoint = base if protocol == "grpc" else base.rstrip("/") + "/v1/traces"
        ratio = self.trace_sample_ratio
        if ratio is None and (arg := _env(environ, "OTEL_TRACES_SAMPLER_ARG")) is not None:
            ratio = _ratio(arg)
        attributes = ",".join(a for a in (environ.get("OTEL_RESOURCE_ATTRIBUTES", "").strip(),
                                          self.otel_resource_attributes) if a)
        return replace(self, otlp_protocol=protocol, otlp_endpoint=endpoint or DEFAULT_ENDPOINT[protocol],
                       otel_service_name=self.otel_service_name or _env(environ, "OTEL_SERVICE_NAME")
                       or DEFAULT_SERVICE,
                       trace_sampler=self.trace_sampler or _sampler(environ), trace_sample_ratio=
                       1.0 if ratio is None else ratio, otel_resource_attributes=attributes)

    @property
    def resolved(self) -> bool:
        return not self.tracing or all(getattr(self, f.name) is not None for f in fields(self))

    def resource(self, role: str, worker_id: str) -> dict[str, str]:
        """The resource attributes of one process: the configured ones, then service.name and
        its place in the cluster (these win)."""
        if role not in ROLES:
            raise ValueError(f"role {role!r}: one of {', '.join(ROLES)}")
        own = parse_attributes(self.otel_resource_attributes or "", "otel_resource_attributes")
        return own | {"service.name": self.otel_service_name or DEFAULT_SERVICE,
                      "halfmoon.role": role, "halfmoon.worker": worker_id}


def _env(environ: Mapping[str, str], *names: str) -> str | None:
    """The first of `names` set to something other than blanks."""
    return next((environ[n].strip() for n in names if environ.get(n, "").strip()), None)


def _ratio(text: str) -> float:
    try:
        ratio = float(text)
    except ValueError:
        raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG={text!r}: expected a ratio in [0, 1]") from None
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG={text!r}: expected a ratio in [0, 1]")
    return ratio


def _sampler(environ: Mapping[str, str]) -> str:
    name = (_env(environ, "OTEL_TRACES_SAMPLER") or "parentbased_always_on").lower()
    if name not in SAMPLERS:
        raise ConfigError(f"OTEL_TRACES_SAMPLER={name!r}: Halfmoon knows {', '.join(SAMPLERS)}")
    return name


def parse_attributes(text: str, where: str) -> dict[str, str]:
    """`k=v,k2=v2` (the OTEL_RESOURCE_ATTRIBUTES syntax; values may be %-encoded) -> a dict."""
    from urllib.parse import unquote

    out: dict[str, str] = {}
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{where}: {item!r} is not key=value")
        out[key.strip()] = unquote(value.strip())
    return out


# ---------------------------------------------------------------------- spans


def now_ns() -> int:
    """Wall-clock nanoseconds: the time base of every span (the same on every node)."""
    return time.time_ns()


def perf_to_ns(perf: float) -> int:
    """A `time.perf_counter()` reading (the engines' clock) as wall-clock nanoseconds."""
    return time.time_ns() - int((time.perf_counter() - perf) * 1e9)


class Event(NamedTuple):
    """A span event recorded after the fact (its own time)."""

    name: str
    at_ns: int
    attributes: Attributes


class Span:
    """A span that records nothing (tracing off, or not sampled): every verb does nothing.
    `OtelSpan` is the recording one."""

    __slots__ = ()

    @property
    def recording(self) -> bool:
        return False

    @property
    def traceparent(self) -> str | None:
        """This span as a W3C traceparent, for the next process (None: nothing to continue)."""
        return None

    @property
    def trace_id(self) -> str | None:
        return None

    def set(self, attributes: Attributes) -> None:
        """Add attributes."""

    def event(self, name: str, attributes: Attributes | None = None, at_ns: int | None = None) -> None:
        """Add an event (now, or at `at_ns`)."""

    def fail(self, error: BaseException) -> None:
        """Mark the span failed by `error` (its type and message)."""

    def end(self, at_ns: int | None = None) -> None:
        """End the span (now, or at `at_ns`); a second end is ignored."""


NO_SPAN = Span()
Parent = Span | str | None  # one of our spans, a traceparent from another process, or none


class Tracer:
    """A process's tracer with tracing off: every span is NO_SPAN. `OtelTracer` records."""

    enabled = False

    def start(self, name: str, parent: Parent, attributes: Attributes | None = None,
              start_ns: int | None = None, server: bool = False, root: bool = False) -> Span:
        """A span under `parent`. Without a parent: a new trace only where `root` (the front
        door); elsewhere NO_SPAN (the request was not sampled). `server`: the span of an
        incoming call (the front door's)."""
        return NO_SPAN

    def record(self, name: str, parent: Parent, start_ns: int, end_ns: int,
               attributes: Attributes | None = None, events: Iterable[Event] = ()) -> Span:
        """A finished span, from times measured elsewhere (an engine's timings, the transport's
        units); returns it (ended) so children can be recorded under it."""
        return NO_SPAN

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Export what is buffered now (before a process is killed); False if it timed out."""
        return True

    def shutdown(self) -> None:
        """Export what is buffered and stop (at process exit)."""


NO_TRACER = Tracer()


class OtelSpan(Span):
    __slots__ = ("span",)

    def __init__(self, span: Any) -> None:
        self.span = span

    @property
    def recording(self) -> bool:
        return True

    @property
    def traceparent(self) -> str | None:
        c = self.span.get_span_context()
        return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"

    @property
    def trace_id(self) -> str | None:
        return f"{self.span.get_span_context().trace_id:032x}"

    def set(self, attributes: Attributes) -> None:
        self.span.set_attributes(attributes)

    def event(self, name: str, attributes: Attributes | None = None, at_ns: int | None = None) -> None:
        self.span.add_event(name, attributes or {}, at_ns)

    def fail(self, error: BaseException) -> None:
        from opentelemetry.trace import Status, StatusCode

        self.span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        self.span.set_attribute("error.type", type(error).__name__)

    def end(self, at_ns: int | None = None) -> None:
        self.span.end(at_ns)


class OtelTracer(Tracer):
    """Spans of one process, batched to an OTLP exporter (`start_tracing` builds it)."""

    enabled = True

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("halfmoon")
        self.propagator = TraceContextTextMapPropagator()

    def start(self, name: str, parent: Parent, attributes: Attributes | None = None,
              start_ns: int | None = None, server: bool = False, root: bool = False) -> Span:
        from opentelemetry.trace import SpanKind, set_span_in_context

        if isinstance(parent, OtelSpan):
            context = set_span_in_context(parent.span)
        elif isinstance(parent, str):
            context = self.propagator.extract({TRACEPARENT: parent})  # malformed: a new trace
        elif parent is None and root:
            context = None
        else:  # NO_SPAN, or no parent outside the front door: the request is not traced
            return NO_SPAN
        span = self.tracer.start_span(name, context, SpanKind.SERVER if server else SpanKind.INTERNAL,
                                      attributes, start_time=start_ns)
        return OtelSpan(span) if span.is_recording() else NO_SPAN

    def record(self, name: str, parent: Parent, start_ns: int, end_ns: int,
               attributes: Attributes | None = None, events: Iterable[Event] = ()) -> Span:
        span = self.start(name, parent, attributes, start_ns)
        for e in events:
            span.event(e.name, e.attributes, e.at_ns)
        span.end(max(start_ns, end_ns))
        return span

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self.provider.force_flush(int(timeout_s * 1e3))

    def shutdown(self) -> None:
        self.provider.shutdown()


def start_tracing(config: TracingConfig, role: str, worker_id: str) -> Tracer:
    """This process's tracer: NO_TRACER when tracing is off, else an SDK TracerProvider with a
    batching OTLP exporter. Raises TracingError when the exporter cannot be built: tracing that
    was asked for never silently does nothing."""
    if not config.tracing:
        return NO_TRACER
    if not config.resolved:
        raise TracingError("a TracingConfig must be resolved (TracingConfig.resolve) before use")
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(sampler=_make_sampler(config, role), resource=Resource.create(
        config.resource(role, worker_id)))
    provider.add_span_processor(BatchSpanProcessor(_exporter(config)))
    return OtelTracer(provider)


def _make_sampler(config: TracingConfig, role: str) -> Any:
    """The configured sampler at the Conductor; a worker follows its parent's decision (it only
    traces what the Conductor sampled)."""
    from opentelemetry.sdk.trace import sampling

    name, ratio = config.trace_sampler or "parentbased_always_on", config.trace_sample_ratio
    ratio = 1.0 if ratio is None else ratio
    root = {"always_on": sampling.ALWAYS_ON, "always_off": sampling.ALWAYS_OFF,
            "parentbased_always_on": sampling.ParentBased(sampling.ALWAYS_ON),
            "parentbased_always_off": sampling.ParentBased(sampling.ALWAYS_OFF),
            "traceidratio": sampling.TraceIdRatioBased(ratio),
            "parentbased_traceidratio": sampling.ParentBased(sampling.TraceIdRatioBased(ratio))}[name]
    return root if role in ("conductor", "colocated") else sampling.ParentBased(sampling.ALWAYS_OFF)


def _exporter(config: TracingConfig) -> Any:
    endpoint = config.otlp_endpoint
    if config.otlp_protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as e:
            raise TracingError(f"tracing over OTLP/gRPC needs opentelemetry-exporter-otlp-proto-grpc: {e}") from e
        return OTLPSpanExporter(endpoint=endpoint)
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
    except ImportError as e:
        raise TracingError(
            "otlp_protocol http/protobuf (OTEL_EXPORTER_OTLP_PROTOCOL) needs the OTLP/HTTP exporter, which "
            "is not installed (pip install opentelemetry-exporter-otlp-proto-http), or use grpc") from e
    return HttpExporter(endpoint=endpoint)
