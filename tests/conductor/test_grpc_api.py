"""The gRPC front door against a real engine: outputs, health, reflection, errors with details,
cancellation and deadlines that free the KV, SLO and overload rejections.

Expected outputs come from `engine`, a second engine on the same weights: the server's engine
is stepped by its own thread and must not be driven from the test thread too."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import \
    ProtoReflectionDescriptorDatabase
from grpc_status import rpc_status

from halfmoon.engine.engine import Engine
from halfmoon.core.params import SamplingParams
from halfmoon.v1 import generation_pb2 as pb
from halfmoon.v1 import generation_pb2_grpc as pb_grpc
from tests.conductor.conftest import MODEL, RunningApi
from tests.waiting import wait_until

PROMPT = "The capital of France is"


def stub(api: RunningApi) -> tuple[grpc.Channel, pb_grpc.GenerationStub]:
    channel = grpc.insecure_channel(api.grpc_target)
    return channel, pb_grpc.GenerationStub(channel)


def collect(responses) -> tuple[list[int], str, pb.Final]:
    ids, text, final = [], "", None
    for r in responses:
        ids += list(r.token_ids)
        text += r.text
        if r.HasField("final"):
            final = r.final
    assert final is not None
    return ids, text, final


def details(error: grpc.RpcError) -> dict[str, object]:
    """The google.rpc details of an error, by type name."""
    status = rpc_status.from_call(error)
    assert status is not None, "no grpc-status-details-bin trailer"
    out: dict[str, object] = {}
    for d in status.details:
        for cls in (error_details_pb2.BadRequest, error_details_pb2.RetryInfo, error_details_pb2.ErrorInfo,
                    pb.SloPrediction):
            if d.Is(cls.DESCRIPTOR):
                msg = cls()
                d.Unpack(msg)
                out[cls.DESCRIPTOR.name] = msg
    return out


def test_generate_streams_the_engines_tokens(api: RunningApi, engine: Engine) -> None:
    ids = api.engine.tokenizer.encode(PROMPT)
    want = engine.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    channel, s = stub(api)
    with channel:
        responses = list(s.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=8, ignore_eos=True)))
    got_ids, text, final = collect(responses)
    assert got_ids == want.output_ids and text == want.text
    assert len(responses) == 9  # one message per token, then the final one
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(ids), 8)
    t = final.timings
    assert t.ttft_ms > 0 and t.prefill_ms > 0 and t.mean_tpot_ms > 0 and t.e2e_ms >= t.ttft_ms
    assert t.queue_ms >= 0 and abs(t.queue_ms + t.prefill_ms - t.ttft_ms) < 1.0


def test_token_ids_chat_and_seeded_sampling(api: RunningApi, engine: Engine) -> None:
    tok = api.engine.tokenizer
    messages = [{"role": "user", "content": "Name a color."}]
    chat_ids = tok.encode(tok.apply_chat_template(messages))
    params = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    want = engine.generate([chat_ids], params)[0]
    channel, s = stub(api)
    sampling = pb.SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    with channel:
        by_chat = collect(s.Generate(pb.GenerateRequest(
            messages=[pb.ChatMessage(**m) for m in messages], max_tokens=6, ignore_eos=True, sampling=sampling)))
        by_ids = collect(s.Generate(pb.GenerateRequest(
            prompt_token_ids=chat_ids, max_tokens=6, ignore_eos=True, sampling=sampling)))
        tokenized = s.Tokenize(pb.TokenizeRequest(messages=[pb.ChatMessage(**m) for m in messages]))
    assert by_chat[0] == by_ids[0] == want.output_ids
    assert list(tokenized.token_ids) == chat_ids


def test_stop_string_and_cached_prompt_tokens(api: RunningApi) -> None:
    channel, s = stub(api)
    prompt = "One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve"  # > 1 block
    with channel:
        first = collect(s.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=4, ignore_eos=True)))
        again = collect(s.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=4, ignore_eos=True)))
        stopped = collect(s.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=16, stop=["."])))
    assert again[0] == first[0]
    assert again[2].usage.cached_prompt_tokens >= 16 > first[2].usage.cached_prompt_tokens
    assert stopped[2].finish_reason == pb.FINISH_REASON_STOP and stopped[2].stop == "."
    assert "." not in stopped[1]


def test_list_models_and_tokenize(api: RunningApi) -> None:
    channel, s = stub(api)
    with channel:
        models = s.ListModels(pb.ListModelsRequest()).models
        ids = s.Tokenize(pb.TokenizeRequest(text=PROMPT)).token_ids
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == api.engine.max_model_len
    assert models[0].vocab_size == api.engine.model_config.vocab_size
    assert list(ids) == api.engine.tokenizer.encode(PROMPT)


def test_health_reports_serving(api: RunningApi) -> None:
    with grpc.insecure_channel(api.grpc_target) as channel:
        h = health_pb2_grpc.HealthStub(channel)
        for service in ("", "halfmoon.v1.Generation"):
            assert h.Check(health_pb2.HealthCheckRequest(service=service)).status == \
                health_pb2.HealthCheckResponse.SERVING


def test_reflection_client_calls_generate_without_stubs(api: RunningApi, engine: Engine) -> None:
    """A generic client: schema from the server's reflection service, messages built from it."""
    with grpc.insecure_channel(api.grpc_target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert {"halfmoon.v1.Generation", "grpc.health.v1.Health"} <= set(db.get_services())
        pool = descriptor_pool.DescriptorPool(db)  # not the default pool our stubs live in
        method = pool.FindServiceByName("halfmoon.v1.Generation").methods_by_name["Generate"]
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        call = channel.unary_stream("/halfmoon.v1.Generation/Generate",
                                    request_serializer=request_cls.SerializeToString,
                                    response_deserializer=response_cls.FromString)
        responses = list(call(request_cls(prompt=PROMPT, max_tokens=4, ignore_eos=True)))
    ids = api.engine.tokenizer.encode(PROMPT)
    want = engine.generate([ids], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert [t for r in responses for t in r.token_ids] == want.output_ids


def test_invalid_argument_names_the_field_in_details(api: RunningApi) -> None:
    channel, s = stub(api)
    with channel, pytest.raises(grpc.RpcError) as err:
        list(s.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(top_p=0.0))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.top_p" in err.value.details()
    bad = details(err.value)["BadRequest"]
    assert bad.field_violations[0].field == "sampling.top_p"


def _long_request(**kw: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=PROMPT, max_tokens=400, ignore_eos=True, **kw)


def test_cancel_frees_the_kv_within_one_step(api: RunningApi) -> None:
    abort_steps: list[int] = []
    real_abort = api.engine.abort

    def observed_abort(request_id: str) -> None:  # records when the backend asked for the abort
        abort_steps.append(api.backend.steps)
        real_abort(request_id)

    api.engine.abort = observed_abort
    try:
        channel, s = stub(api)
        with channel:
            call = s.Generate(_long_request())
            responses = iter(call)
            for _ in range(3):
                next(responses)
            assert api.engine.pool.num_free() < api.engine.pool.num_blocks  # it holds KV now
            call.cancel()
            assert api.wait_idle() == []
    finally:
        del api.engine.abort  # back to the class's method
    assert len(abort_steps) == 1
    # `steps` counts steps started (one in flight at the abort included), and the engine only
    # steps while it has work: the step that drained the abort is the last one.
    assert api.backend.steps - abort_steps[0] <= 1
    api.engine.pool.check_integrity()


def test_deadline_exceeded_stops_the_work(api: RunningApi) -> None:
    channel, s = stub(api)
    t0 = time.monotonic()
    with channel, pytest.raises(grpc.RpcError) as err:
        list(s.Generate(_long_request(), timeout=0.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 5
    assert api.wait_idle() == []


def test_server_side_deadline_is_the_grpc_deadline(api: RunningApi) -> None:
    """The backend sees the call's deadline: requests that cannot make it are stopped there too."""
    seen: list[float | None] = []
    real = api.backend.generate

    def spy(inp):
        seen.append(inp.deadline)
        return real(inp)

    api.backend.generate = spy
    try:
        channel, s = stub(api)
        with channel:
            collect(s.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=2), timeout=30))
            collect(s.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=2)))
    finally:
        del api.backend.generate
    assert seen[0] is not None and 20 < seen[0] - time.monotonic() < 31
    assert seen[1] is None


def test_slo_miss_is_rejected_with_predictions(api: RunningApi) -> None:
    channel, s = stub(api)
    with channel:
        collect(s.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=4, ignore_eos=True)))  # measured
        with pytest.raises(grpc.RpcError) as err:
            list(s.Generate(pb.GenerateRequest(prompt=PROMPT, slo=pb.Slo(ttft_ms=1e-3, tbt_ms=1e-3))))
        ok = collect(s.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=2, slo=pb.Slo(ttft_ms=1e6))))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "predicted TTFT" in err.value.details() and "predicted TBT" in err.value.details()
    d = details(err.value)
    p = d["SloPrediction"]
    assert p.predicted_ttft_ms > p.ttft_slo_ms == pytest.approx(1e-3)
    assert p.predicted_tbt_ms > 0
    assert d["RetryInfo"].retry_delay.ToMilliseconds() >= 0
    assert (d["ErrorInfo"].reason, d["ErrorInfo"].metadata["error"]) == ("ttft", "SloMissError")
    assert ok[2].usage.completion_tokens == 2


def test_overload_is_rejected_and_the_rest_complete(start_api) -> None:
    small = start_api(max_waiting=1)
    results: list[object] = []

    def one() -> None:
        with grpc.insecure_channel(small.grpc_target) as channel:
            try:
                results.append(collect(pb_grpc.GenerationStub(channel).Generate(
                    pb.GenerateRequest(prompt=PROMPT * 20, max_tokens=2))))
            except grpc.RpcError as e:
                results.append(e)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    errors = [r for r in results if isinstance(r, grpc.RpcError)]
    assert len(results) == 6 and errors and len(errors) < 6
    assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in errors)
    assert all("waiting for their first token" in e.details() for e in errors)
    assert details(errors[0])["ErrorInfo"].metadata["error"] == "OverloadedError"
    assert small.wait_idle() == []


def test_a_failed_engine_is_unavailable_and_unhealthy(start_api) -> None:
    """A bug inside the engine step: the running request fails with UNAVAILABLE (not a hang),
    new ones are refused with UNAVAILABLE, both health checks say so."""
    doomed = start_api()

    def broken_step() -> list:
        raise RuntimeError("injected engine failure")

    doomed.engine.step = broken_step
    with grpc.insecure_channel(doomed.grpc_target) as channel:
        s = pb_grpc.GenerationStub(channel)
        for _ in range(2):  # the one that meets the failure, then one after it
            with pytest.raises(grpc.RpcError) as err:
                list(s.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=4), timeout=30))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "injected engine failure" in err.value.details()
        h = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        wait_until(lambda: h.Check(health_pb2.HealthCheckRequest(service="")).status != serving,
                   timeout_s=5, what="gRPC health to stop SERVING after the engine failed")
    import httpx

    assert httpx.get(doomed.http_url + "/health").status_code == 503
