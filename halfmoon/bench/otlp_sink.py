"""A minimal OpenTelemetry collector: the OTLP/gRPC TraceService (opentelemetry-proto) on a grpcio
server, keeping what it receives. What `halfmoon bench serve --otlp-sink` points the server's
tracing at (so tracing's cost is measured with a real exporter and nothing dropped), and what the
tracing test asserts on.

    with OtlpSink() as sink:                 # 127.0.0.1, a free port
        ... --tracing --otlp-endpoint sink.endpoint ...
        sink.spans()                         # every span received: (resource attributes, span)
"""

from __future__ import annotations

import threading
from concurrent import futures
from typing import Any, NamedTuple

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span


class ReceivedSpan(NamedTuple):
    """A span as the collector got it, with its process's resource attributes."""

    resource: dict[str, Any]
    span: Span

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def attributes(self) -> dict[str, Any]:
        return {a.key: value(a.value) for a in self.span.attributes}


def value(v: AnyValue) -> Any:
    """An OTLP attribute value as Python."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind is not None else None


class _TraceService(pb_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpSink) -> None:
        self.sink = sink

    def Export(self, request: pb.ExportTraceServiceRequest, context: grpc.ServicerContext
               ) -> pb.ExportTraceServiceResponse:  # noqa: N802 - the generated servicer's name
        received = []
        for rs in request.resource_spans:
            resource = {a.key: value(a.value) for a in rs.resource.attributes}
            received += [ReceivedSpan(resource, s) for ss in rs.scope_spans for s in ss.spans]
        with self.sink.lock:
            self.sink.received.extend(received)
            self.sink.exports += 1
        return pb.ExportTraceServiceResponse()


class OtlpSink:
    """An OTLP/gRPC trace receiver on `host` (port 0 = a free one); `endpoint` is its URL."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.lock = threading.Lock()
        self.received: list[ReceivedSpan] = []
        self.exports = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"the OTLP sink cannot bind {host}:{port}")
        self.endpoint = f"http://{host}:{self.port}"

    def start(self) -> OtlpSink:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(grace=1.0).wait(5.0)

    def __enter__(self) -> OtlpSink:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def spans(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.received)
