"""One request is one trace across the Conductor, the prefill worker and the decode worker (issue
22, point 1): a real OTLP/gRPC receiver in this process (bench/otlp_sink.py: opentelemetry-proto's
TraceService on a grpcio server), a 1P1D cluster with real Ray workers exporting to it, one
streaming chat request carrying the client's W3C traceparent.

What must hold:
- every span has the client's trace id; the front door's span is the child of the client's;
- the spans come from three processes, told apart by their resource (halfmoon.role conductor /
  prefill / decode, halfmoon.worker), with the parent links of core/tracing.py's diagram;
- the KV transfer is one span (exported by the decode worker, under the prefill worker's span:
  its traceparent crossed the KV transport) with a `kv.layer` event per model layer;
- durations add up: the front door's span is the end-to-end time the client measured (within
  10%), and the request's critical path, each phase on the process that spent it,

      halfmoon.admission + halfmoon.reserve                      (Conductor)
    + prefill.queue + prefill.compute + prefill.kv_push          (prefill worker)
    + decode.queue + decode.compute                              (decode worker)

  sums to the front door's span within 10% (what is left: Ray calls and streaming hops), the
  phases one after another in that order.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import httpx
import pytest

from halfmoon.bench.otlp_sink import OtlpSink, ReceivedSpan
from halfmoon.core.tracing import TracingConfig
from halfmoon.v1 import generation_pb2 as pb
from halfmoon.v1 import generation_pb2_grpc as pb_grpc
from halfmoon.kvpool.redis_server import EmbeddedRedis
from tests.e2e.support import start_cluster
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
GRPC_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CRITICAL_PATH = ("halfmoon.admission", "halfmoon.reserve", "prefill.queue", "prefill.compute",
                 "prefill.kv_push", "decode.queue", "decode.compute")
FRONT_DOOR = "POST /v1/chat/completions"
TOLERANCE = 0.10


def of_trace(spans: list[ReceivedSpan], trace_id: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.span.trace_id.hex() == trace_id]


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{name}: {len(found)} spans ({sorted(s.name for s in spans)})"
    return found[0]


def ms(s: ReceivedSpan) -> float:
    return (s.span.end_time_unix_nano - s.span.start_time_unix_nano) / 1e6


def parent_of(child: ReceivedSpan, parent: ReceivedSpan) -> bool:
    return child.span.parent_span_id == parent.span.span_id


def complete(spans: list[ReceivedSpan], trace_id: str) -> bool:
    """Every span of a traced request has arrived (the workers batch theirs: ~5 s)."""
    names = {s.name for s in of_trace(spans, trace_id)}
    return {*CRITICAL_PATH, "prefill", "decode", "decode.kv_wait", "kv_transfer"} <= names


def stream_chat(http_url: str, prompt: str, max_tokens: int) -> tuple[float, str]:
    """(end-to-end ms as the client measured it: request sent -> [DONE], the text)."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    text = []
    start = time.perf_counter()
    with httpx.stream("POST", f"{http_url}/v1/chat/completions", json=body, timeout=120,
                      headers={"traceparent": TRACEPARENT}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line == "data: [DONE]":
                break
            if line.startswith("data: "):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text.append(delta.get("content") or "")
    return (time.perf_counter() - start) * 1e3, "".join(text)


def test_one_request_is_one_trace_across_three_processes(tmp_path: Path, redis: EmbeddedRedis) -> None:
    with OtlpSink() as sink:
        tracing = TracingConfig(tracing=True, otlp_endpoint=sink.endpoint).resolve({})
        cluster = start_cluster(tmp_path, 1, 1, redis, "tcp", tracing=tracing)
        try:
            # ~600 prompt tokens: three prefill chunks of 256 (the cluster's max_num_batched_tokens).
            e2e_ms, text = stream_chat(cluster.endpoints.http_url, "Tell me about the sea. " * 100, 24)
            assert text
            with grpc.insecure_channel(cluster.grpc_target) as channel:
                request = pb.GenerateRequest(prompt="The capital of France is", max_tokens=4, ignore_eos=True)
                metadata = (("traceparent", f"00-{GRPC_TRACE_ID}-{CLIENT_SPAN}-01"),)
                assert list(pb_grpc.GenerationStub(channel).Generate(request, timeout=120, metadata=metadata))
            wait_until(lambda: complete(sink.spans(), TRACE_ID) and complete(sink.spans(), GRPC_TRACE_ID),
                       60, "every span of both requests at the receiver")
        finally:
            cluster.stop()  # flushes the Conductor's spans
        spans = sink.spans()
    check_the_trace(of_trace(spans, TRACE_ID), e2e_ms)
    assert one(of_trace(spans, GRPC_TRACE_ID), "halfmoon.v1.Generation/Generate").span.parent_span_id.hex() \
        == CLIENT_SPAN


def check_the_trace(trace: list[ReceivedSpan], e2e_ms: float) -> None:
    door = one(trace, FRONT_DOOR)
    assert door.span.parent_span_id.hex() == CLIENT_SPAN  # the client's span is its parent
    assert door.resource["halfmoon.role"] == "conductor" and door.resource["service.name"] == "halfmoon"
    roles = {s.resource["halfmoon.role"]: s.resource["halfmoon.worker"] for s in trace}
    assert roles == {"conductor": "conductor", "prefill": "prefill-0", "decode": "decode-0"}
    check_parents(trace, door)
    check_transfer(trace)
    check_durations(trace, door, e2e_ms)


def check_parents(trace: list[ReceivedSpan], door: ReceivedSpan) -> None:
    prefill, decode = one(trace, "prefill"), one(trace, "decode")
    expected = {"halfmoon.admission": door, "halfmoon.reserve": door, "prefill": door, "decode": door,
                "prefill.queue": prefill, "prefill.compute": prefill, "prefill.kv_push": prefill,
                "decode.kv_wait": decode, "decode.queue": decode, "decode.compute": decode,
                "kv_transfer": prefill}
    for name, parent in expected.items():
        assert parent_of(one(trace, name), parent), f"{name} is not a child of {parent.name}"
    role = {"prefill": "prefill", "prefill.compute": "prefill", "decode": "decode", "kv_transfer": "decode",
            "halfmoon.admission": "conductor"}
    for name, r in role.items():
        assert one(trace, name).resource["halfmoon.role"] == r, name
    admission = one(trace, "halfmoon.admission").attributes
    assert admission["halfmoon.admission.decision"] == "admit"
    assert (admission["halfmoon.prefill_worker"], admission["halfmoon.decode_worker"]) == ("prefill-0", "decode-0")
    assert decode.attributes["halfmoon.output_tokens"] == 24
    assert [e.name for e in decode.span.events] == ["first_token"]
    chunks = [e for e in one(trace, "prefill.compute").span.events if e.name == "chunk"]
    assert len(chunks) >= 2, "a chunked prefill has an event per chunk"


def check_transfer(trace: list[ReceivedSpan]) -> None:
    transfer = one(trace, "kv_transfer")
    layers = [e for e in transfer.span.events if e.name == "kv.layer"]
    attrs = [{a.key: a.value for a in e.attributes} for e in layers]
    assert [a["layer"].int_value for a in attrs] == list(range(len(layers))) and len(layers) >= 2
    units = sum(a["units"].int_value for a in attrs)
    assert units == transfer.attributes["halfmoon.kv_units"]
    assert sum(a["bytes"].int_value for a in attrs) == transfer.attributes["halfmoon.kv_bytes"] > 0
    for a in attrs:
        checksums = [v.string_value for v in a["checksums"].array_value.values]
        assert len(checksums) == a["units"].int_value and all(len(c) == 16 for c in checksums)


def check_durations(trace: list[ReceivedSpan], door: ReceivedSpan, e2e_ms: float) -> None:
    assert abs(ms(door) - e2e_ms) <= TOLERANCE * e2e_ms, f"front door {ms(door):.1f} ms vs client {e2e_ms:.1f} ms"
    path = [one(trace, name) for name in CRITICAL_PATH]
    total = sum(ms(s) for s in path)
    listing = ", ".join(f"{s.name} {ms(s):.1f}" for s in path)
    assert abs(total - ms(door)) <= TOLERANCE * ms(door), f"{listing}: {total:.1f} ms vs {ms(door):.1f} ms"
    slack_ns = 5e6  # clocks of the three processes are one wall clock; ordering within 5 ms
    for before, after in zip(path, path[1:]):
        assert after.span.start_time_unix_nano >= before.span.end_time_unix_nano - slack_ns, \
            f"{after.name} starts before {before.name} ends ({listing})"
    assert path[0].span.start_time_unix_nano >= door.span.start_time_unix_nano
    assert path[-1].span.end_time_unix_nano <= door.span.end_time_unix_nano + slack_ns
