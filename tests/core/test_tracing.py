"""Tracing's configuration (flags > OTEL_* variables > defaults), off by default at no cost, and
the spans it makes: a client's traceparent continued, workers only under a sampled parent,
spans recorded after the fact with their events."""

from __future__ import annotations

import subprocess
import sys

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from halfmoon.cli.components import TRACING
from halfmoon.cli.flags import build
from halfmoon.cli.main import parse_args
from halfmoon.core.errors import ConfigError
from halfmoon.core.tracing import (NO_SPAN, NO_TRACER, Event, OtelTracer, TracingConfig, TracingError,
                          _make_sampler, start_tracing)

CLIENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
ON = TracingConfig(tracing=True)


def test_off_by_default_and_the_environment_does_not_turn_it_on() -> None:
    config = build(TRACING, parse_args(["serve"]))
    assert config == TracingConfig() and not config.tracing
    assert config.resolve({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}) == config
    assert start_tracing(config, "conductor", "conductor") is NO_TRACER


def test_off_imports_no_sdk_and_builds_no_exporter() -> None:
    """In a fresh interpreter: the front door's and the workers' tracing code with tracing off
    leaves the tracing SDK and the exporters unimported (no provider, no exporter, no thread).
    (redis-py imports OpenTelemetry's metrics SDK on its own when it is installed.)"""
    code = ("import sys, threading\n"
            "from halfmoon.core.tracing import TracingConfig, start_tracing, NO_SPAN\n"
            "import halfmoon.api.frontdoor, halfmoon.decode_worker.worker, halfmoon.prefill_worker.worker\n"
            "t = start_tracing(TracingConfig(), 'conductor', 'conductor')\n"
            "assert t.start('x', None, root=True) is NO_SPAN\n"
            "loaded = [m for m in sys.modules if m.startswith(('opentelemetry.sdk.trace', 'opentelemetry.exporter'))]\n"
            "assert not loaded, loaded\n"
            "assert threading.active_count() == 1, threading.enumerate()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_otel_variables_fill_what_no_flag_set() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_SERVICE_NAME": "llm",
           "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25",
           "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,team=serving"}
    got = ON.resolve(env)
    assert (got.otlp_endpoint, got.otlp_protocol, got.otel_service_name) == ("http://collector:4317", "grpc", "llm")
    assert (got.trace_sampler, got.trace_sample_ratio) == ("parentbased_traceidratio", 0.25)
    assert got.resource("prefill", "prefill-0") == {
        "deployment.environment": "prod", "team": "serving", "service.name": "llm",
        "halfmoon.role": "prefill", "halfmoon.worker": "prefill-0"}
    assert got.resolved


def test_the_signal_specific_variables_win_and_defaults_apply() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://base:4317",
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://traces:4317"}
    assert ON.resolve(env).otlp_endpoint == "https://traces:4317"
    plain = ON.resolve({})
    assert (plain.otlp_endpoint, plain.otel_service_name, plain.trace_sampler, plain.trace_sample_ratio) == (
        "http://localhost:4317", "halfmoon", "parentbased_always_on", 1.0)
    http = ON.resolve({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"})
    assert (http.otlp_protocol, http.otlp_endpoint) == ("http/protobuf", "http://c:4318/v1/traces")


def test_flags_and_their_env_beat_the_otel_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HALFMOON_TRACING", "1")
    monkeypatch.setenv("HALFMOON_TRACE_SAMPLE_RATIO", "0.5")
    args = parse_args(["serve", "--otlp-endpoint", "http://flag:4317", "--otel-service-name", "svc",
                       "--trace-sampler", "traceidratio", "--otel-resource-attributes", "a=1"])
    got = build(TRACING, args).resolve({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4317",
                                        "OTEL_SERVICE_NAME": "env", "OTEL_TRACES_SAMPLER": "always_off",
                                        "OTEL_TRACES_SAMPLER_ARG": "0.1", "OTEL_RESOURCE_ATTRIBUTES": "a=0,b=2"})
    assert (got.tracing, got.otlp_endpoint, got.otel_service_name) == (True, "http://flag:4317", "svc")
    assert (got.trace_sampler, got.trace_sample_ratio) == ("traceidratio", 0.5)
    assert got.resource("conductor", "conductor")["a"] == "1"  # the flag's, after the variable's
    assert got.resource("conductor", "conductor")["b"] == "2"


@pytest.mark.parametrize("env, message", [
    ({"OTEL_TRACES_SAMPLER": "jaeger_remote"}, "OTEL_TRACES_SAMPLER"),
    ({"OTEL_TRACES_SAMPLER_ARG": "1.5"}, "OTEL_TRACES_SAMPLER_ARG"),
    ({"OTEL_TRACES_SAMPLER_ARG": "half"}, "OTEL_TRACES_SAMPLER_ARG"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "novalue"}, "not key=value"),
])
def test_a_bad_variable_is_a_config_error_naming_it(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ON.resolve(env).resource("conductor", "c")


def test_bad_fields_are_config_errors() -> None:
    for bad in ({"otlp_protocol": "thrift"}, {"trace_sampler": "sometimes"}, {"trace_sample_ratio": 2.0}):
        with pytest.raises(ConfigError):
            TracingConfig(tracing=True, **bad)


def test_http_protobuf_without_its_exporter_says_so() -> None:
    config = ON.resolve({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    try:
        import opentelemetry.exporter.otlp.proto.http  # noqa: F401
    except ImportError:
        with pytest.raises(TracingError, match="opentelemetry-exporter-otlp-proto-http"):
            start_tracing(config, "conductor", "conductor")
    else:
        start_tracing(config, "conductor", "conductor").shutdown()


def test_an_unresolved_config_is_refused() -> None:
    with pytest.raises(TracingError, match="resolve"):
        start_tracing(ON, "conductor", "conductor")


def test_on_builds_an_otlp_tracer_with_the_process_resource() -> None:
    tracer = start_tracing(ON.resolve({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}), "decode", "decode-3")
    try:
        assert isinstance(tracer, OtelTracer)
        attributes = tracer.provider.resource.attributes
        assert (attributes["halfmoon.role"], attributes["halfmoon.worker"], attributes["service.name"]) == (
            "decode", "decode-3", "halfmoon")
    finally:
        tracer.shutdown()


def memory_tracer(role: str, sampler: str = "parentbased_always_on") -> tuple[OtelTracer, InMemorySpanExporter]:
    spans = InMemorySpanExporter()
    config = TracingConfig(tracing=True, trace_sampler=sampler).resolve({})
    provider = TracerProvider(sampler=_make_sampler(config, role))
    provider.add_span_processor(SimpleSpanProcessor(spans))
    return OtelTracer(provider), spans


def test_a_clients_traceparent_is_continued_across_processes() -> None:
    door, door_spans = memory_tracer("conductor")
    worker, worker_spans = memory_tracer("prefill")
    request = door.start("POST /v1/chat/completions", CLIENT, server=True, root=True)
    assert request.trace_id == CLIENT.split("-")[1]
    remote = worker.start("prefill", request.traceparent)
    worker.record("prefill.queue", remote, 1_000, 2_000, {"k": 1}, [Event("chunk", 1_500, {"chunk": 0})])
    remote.end()
    request.end()
    (front,) = door_spans.get_finished_spans()
    queue, prefill = worker_spans.get_finished_spans()
    assert front.parent.span_id == int(CLIENT.split("-")[2], 16) and front.parent.is_remote
    assert prefill.parent.span_id == front.context.span_id
    assert queue.parent.span_id == prefill.context.span_id
    assert (queue.start_time, queue.end_time, queue.events[0].timestamp) == (1_000, 2_000, 1_500)
    assert {s.context.trace_id for s in (front, prefill, queue)} == {int(CLIENT.split("-")[1], 16)}


def test_workers_trace_only_under_a_sampled_parent() -> None:
    worker, spans = memory_tracer("decode")
    assert worker.start("decode", None) is NO_SPAN
    assert worker.start("decode", UNSAMPLED) is NO_SPAN
    assert worker.start("decode", NO_SPAN) is NO_SPAN
    assert worker.start("decode", CLIENT).recording
    door, _ = memory_tracer("conductor", "always_off")
    assert door.start("GET", None, root=True) is NO_SPAN


def test_the_no_op_span_and_tracer_do_nothing() -> None:
    span = NO_TRACER.start("x", CLIENT, root=True)
    assert span is NO_SPAN and not span.recording and span.traceparent is None
    span.set({"a": 1})
    span.event("e")
    span.fail(ValueError("x"))
    span.end()
    assert NO_TRACER.record("x", CLIENT, 0, 1) is NO_SPAN
