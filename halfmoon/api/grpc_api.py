"""The gRPC front door: service `halfmoon.v1.Generation`, plus standard health and reflection.
Its admin RPCs (LoadAdapter, UnloadAdapter, ListAdapters) are api/admin.py's verbs.

Requests are decoded by our own deserializer so a malformed message (e.g. a string field that
is not UTF-8) is INVALID_ARGUMENT with a message, not grpc's generic INTERNAL. Every error
leaves as one status (see `conductor/errors.py`) with a `google.rpc.Status` in the trailer:
BadRequest for a bad field; for a rejection, RetryInfo, ErrorInfo (reason: admission's, e.g.
`ttft`; metadata `error`: the error's class) and SloPrediction when admission predicted anything.
A `traceparent` in the call's metadata (W3C) makes the request's trace a part of the client's.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import DecodeError, Message
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from halfmoon.api.admin import GRPC_FIELDS, AdapterAdmin
from halfmoon.conductor.adapters import AdapterInfo
from halfmoon.conductor.errors import RetryableRejection, client_message, field_of, status_of
from halfmoon.api.structured import from_proto
from halfmoon.api.tool_formats import ToolFormat
from halfmoon.api.tools import ToolCall, calls_of
from halfmoon.api.tools import from_proto as tools_from_proto
from halfmoon.api.frontdoor import Call, FrontDoor
from halfmoon.api.rejection import reason_of
from halfmoon.api.requests import RequestSpec, check_messages, check_model, prompt_ids
from halfmoon.core.errors import InvalidRequestError
from halfmoon.core.messages import ChoiceEnd, RequestEnd, SloPrediction, TokenLogprobs
from halfmoon.core.tracing import TRACEPARENT
from halfmoon.v1 import generation_pb2 as pb

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT,
          "tool_calls": pb.FINISH_REASON_TOOL_CALLS}
# gRPC field spellings, for error messages that name the client's field.
NAMES = {"temperature": "sampling.temperature", "top_p": "sampling.top_p", "top_k": "sampling.top_k",
         "seed": "sampling.seed", "ttft_ms": "slo.ttft_ms", "tbt_ms": "slo.tbt_ms",
         **{k: f"sampling.{k}" for k in ("frequency_penalty", "presence_penalty", "repetition_penalty",
                                         "logit_bias", "min_tokens")}}


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A request body that did not parse as its message type."""

    error: str


def _decoder(cls: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    def decode(data: bytes) -> Message | Undecodable:
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return Undecodable(f"not a valid {cls.DESCRIPTOR.full_name} ({e}; string fields must be UTF-8)")

    return decode


def peer_host(peer: str) -> str:
    """grpc's "ipv4:127.0.0.1:5555" / "ipv6:[::1]:5555" -> the address, as HTTP reports it."""
    _, _, address = peer.partition(":")
    host = address.rsplit(":", 1)[0] if address.count(":") >= 1 else address
    return host.strip("[]")


def spec_from_proto(req: pb.GenerateRequest, deadline: float | None) -> RequestSpec:
    s, slo = req.sampling, req.slo
    return RequestSpec(
        model=req.model, prompt=req.prompt if req.HasField("prompt") else None,
        messages=[chat_message(m, i) for i, m in enumerate(req.messages)] or None,
        prompt_token_ids=list(req.prompt_token_ids) or None,
        max_tokens=req.max_tokens if req.HasField("max_tokens") else None,
        temperature=s.temperature if s.HasField("temperature") else None,
        top_p=s.top_p if s.HasField("top_p") else None, top_k=s.top_k if s.HasField("top_k") else None,
        seed=s.seed if s.HasField("seed") else None, stop=list(req.stop),
        stop_token_ids=list(req.stop_token_ids), ignore_eos=req.ignore_eos,
        speculative=req.speculative if req.HasField("speculative") else True,
        ttft_ms=slo.ttft_ms if slo.HasField("ttft_ms") else None,
        tbt_ms=slo.tbt_ms if slo.HasField("tbt_ms") else None, priority=req.priority,
        priority_class=req.priority_class or None, cache_salt=req.cache_salt or None, request_id=req.request_id or None, deadline=deadline,
        frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else None,
        presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else None,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else None,
        logit_bias=dict(s.logit_bias), min_tokens=s.min_tokens if s.HasField("min_tokens") else None,
        logprobs=req.logprobs if req.HasField("logprobs") else None,
        prompt_logprobs=req.prompt_logprobs if req.HasField("prompt_logprobs") else None,
        n=req.n if req.HasField("n") else 1, constraint=from_proto(req.constraint),
        tools=tools_from_proto(req.tools, req.tool_choice,
                               req.parallel_tool_calls if req.HasField("parallel_tool_calls") else None),
        names={**NAMES, "constraint": f"constraint.{req.constraint.WhichOneof('kind')}"})


def chat_message(m: pb.ChatMessage, i: int) -> dict[str, Any]:
    """A turn as the template takes it: an assistant's calls, a tool result's call id."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = calls_of([{"id": c.id, "type": "function", "function": {"name": c.name,
                                       "arguments": c.arguments}} for c in m.tool_calls], f"messages[{i}].tool_calls")
    if m.role == "tool":
        if not m.tool_call_id:
            raise InvalidRequestError(f"messages[{i}].tool_call_id", "is required in a tool turn")
        out["tool_call_id"] = m.tool_call_id
    return out


def logprobs_proto(token_ids: list[int], logprobs: tuple[TokenLogprobs, ...] | None) -> list[pb.TokenLogprob]:
    if not logprobs:
        return []
    return [pb.TokenLogprob(token_id=t, logprob=lp.logprob, top=[pb.TopLogprob(token_id=i, logprob=v) for i, v in lp.top])
            for t, lp in zip(token_ids, logprobs)]


def choice_end_proto(end: ChoiceEnd | None) -> pb.ChoiceEnd | None:
    if end is None:
        return None
    return pb.ChoiceEnd(finish_reason=FINISH[end.finish_reason.value], stop=end.stop or "",
                        completion_tokens=end.completion_tokens)


def final_proto(end: RequestEnd) -> pb.Final:
    u, t = end.usage, end.timings
    final = pb.Final(finish_reason=FINISH[end.finish_reason.value], stop=end.stop or "",
                     usage=pb.Usage(prompt_tokens=u.prompt_tokens, cached_prompt_tokens=u.cached_prompt_tokens,
                                    completion_tokens=u.completion_tokens),
                     timings=pb.Timings(queue_ms=t.queue_ms, prefill_ms=t.prefill_ms, transfer_ms=t.transfer_ms,
                                        ttft_ms=t.ttft_ms, mean_tpot_ms=t.mean_tpot_ms, e2e_ms=t.e2e_ms))
    if end.prediction is not None:
        final.prediction.CopyFrom(prediction_proto(end.prediction))
    return final


class Calls:
    """Each choice's text, read for tool calls when it ends (the stream carries what the model
    wrote; the end message, its calls and the text before them)."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.texts: dict[int, list[str]] = {}

    def add(self, index: int, text: str) -> None:
        self.texts.setdefault(index, []).append(text)

    def fill(self, end: pb.Final | pb.ChoiceEnd, index: int) -> None:
        parsed = self.fmt.parse("".join(self.texts.get(index, ())))
        if not parsed.calls:
            return
        end.tool_calls.extend(tool_call_proto(c) for c in parsed.calls)
        end.content = parsed.content
        if end.finish_reason == pb.FINISH_REASON_STOP:
            end.finish_reason = pb.FINISH_REASON_TOOL_CALLS


def tool_call_proto(call: ToolCall) -> pb.ToolCall:
    return pb.ToolCall(id=call.id, name=call.name, arguments=call.arguments)


def adapter_proto(info: AdapterInfo) -> pb.AdapterInfo:
    return pb.AdapterInfo(name=info.name, path=info.path, digest=info.digest, rank=info.rank,
                          target_modules=list(info.targets), base_model=info.base_model, load_ms=info.load_ms,
                          loaded_at=info.loaded_at)


def prediction_proto(p: SloPrediction) -> pb.SloPrediction:
    return pb.SloPrediction(predicted_ttft_ms=p.predicted_ttft_ms, predicted_tbt_ms=p.predicted_tbt_ms,
                            ttft_slo_ms=p.ttft_slo_ms, tbt_slo_ms=p.tbt_slo_ms)


def rich_status(error: BaseException) -> grpc.Status:
    """The error as a gRPC status with google.rpc details a client can act on."""
    st = status_of(error)
    details: list[Message] = []
    field = field_of(error)
    if field is not None:
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=str(error))
        details.append(error_details_pb2.BadRequest(field_violations=[violation]))
    if isinstance(error, RetryableRejection):
        details += _rejection_details(error)
    packed = []
    for d in details:
        a = any_pb2.Any()
        a.Pack(d)
        packed.append(a)
    return rpc_status.to_status(status_pb2.Status(code=st.grpc.value[0], message=client_message(error),
                                                  details=packed))


def _rejection_details(error: RetryableRejection) -> list[Message]:
    delay = duration_pb2.Duration()
    delay.FromMilliseconds(math.ceil(error.retry_after_s * 1e3))
    out: list[Message] = [
        error_details_pb2.ErrorInfo(reason=reason_of(error), domain="halfmoon",
                                    metadata={"error": type(error).__name__}),
        error_details_pb2.RetryInfo(retry_delay=delay)]
    if error.prediction is not None:
        out.append(prediction_proto(error.prediction))
    return out


class GenerationService:
    """The handlers; each checks auth, maps every error to its one status."""

    def __init__(self, door: FrontDoor) -> None:
        self.door = door
        self.admin = AdapterAdmin(door.backend, door.admin)

    def _client(self, context: grpc.aio.ServicerContext) -> str:
        metadata = dict(context.invocation_metadata() or ())
        return self.door.client(metadata.get("authorization"), peer_host(context.peer()))

    async def _fail(self, context: grpc.aio.ServicerContext, error: BaseException) -> None:
        if status_of(error).grpc is grpc.StatusCode.INTERNAL:
            log.error("internal error in a gRPC call", exc_info=error)
        self.door.count_error("grpc", error)
        status = rich_status(error)
        await context.abort(status.code, status.details, trailing_metadata=status.trailing_metadata)

    async def generate(self, request: pb.GenerateRequest | Undecodable,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        try:
            client = self._client(context)
            if isinstance(request, Undecodable):
                raise InvalidRequestError("request", request.error)
            remaining = context.time_remaining()
            deadline = None if remaining is None else time.monotonic() + remaining
            call = Call(f"{SERVICE}/Generate", {"rpc.system": "grpc", "rpc.service": SERVICE,
                                                "rpc.method": "Generate", "halfmoon.api": "grpc"},
                        dict(context.invocation_metadata() or ()).get(TRACEPARENT))
            spec = spec_from_proto(request, deadline)
            prompt_ids = None if spec.prompt_logprobs is None else self._prompt_ids(spec)
            calls = Calls(self.door.tool_format) if spec.tools is not None and spec.tools.active else None
            async for item in self.door.generate(spec, client, "grpc", call):
                prompt = [] if prompt_ids is None else logprobs_proto(prompt_ids[1:], item.prompt_logprobs)
                if calls is not None:
                    calls.add(item.index, item.text)
                if item.token_ids or item.text or prompt or item.choice_end is not None:
                    end = choice_end_proto(item.choice_end)
                    if end is not None and calls is not None:
                        calls.fill(end, item.index)
                    yield pb.GenerateResponse(request_id=item.request_id, token_ids=item.token_ids, text=item.text,
                                              logprobs=logprobs_proto(item.token_ids, item.logprobs),
                                              prompt_logprobs=prompt, index=item.index, choice_end=end)
                if item.end is not None:
                    final = final_proto(item.end)
                    if calls is not None:
                        calls.fill(final, 0)
                    yield pb.GenerateResponse(request_id=item.request_id, final=final)
        except Exception as e:  # ours map to their status; anything else is INTERNAL, logged
            await self._fail(context, e)

    def _prompt_ids(self, spec: RequestSpec) -> list[int]:
        """The request's prompt as the front door tokenizes it (what its prompt logprobs are of)."""
        b = self.door.backend
        return prompt_ids(spec, b.tokenizer, b.model, self.door.limits)

    async def tokenize(self, request: pb.TokenizeRequest | Undecodable,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            self.door.client(dict(context.invocation_metadata() or ()).get("authorization"), "")
            if isinstance(request, Undecodable):
                raise InvalidRequestError("request", request.error)
            backend = self.door.backend
            check_model(request.model, backend.model, backend.adapters)
            ids = _tokenize(request, backend, self.door.limits)
            return pb.TokenizeResponse(token_ids=ids, max_model_len=backend.model.max_model_len)
        except Exception as e:
            await self._fail(context, e)
            raise AssertionError("unreachable: abort raises") from e

    async def list_models(self, request: pb.ListModelsRequest | Undecodable,
                          context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        try:
            self.door.client(dict(context.invocation_metadata() or ()).get("authorization"), "")
            if isinstance(request, Undecodable):  # an empty message, but garbage is still no request
                raise InvalidRequestError("request", request.error)
            b = self.door.backend
            m = b.model
            base = pb.ModelInfo(id=m.id, max_model_len=m.max_model_len, vocab_size=m.vocab_size,
                                owned_by=m.owned_by, architecture=m.architecture, dtype=m.dtype)
            adapters = b.adapters.list() if b.adapters is not None else []
            return pb.ListModelsResponse(models=[base, *(pb.ModelInfo(
                id=a.name, max_model_len=m.max_model_len, vocab_size=m.vocab_size, owned_by=m.owned_by,
                architecture=m.architecture, dtype=m.dtype, parent=m.id) for a in adapters)])
        except Exception as e:
            await self._fail(context, e)
            raise AssertionError("unreachable: abort raises") from e

    def _admin(self, request: Message | Undecodable, context: grpc.aio.ServicerContext) -> Message:
        """The admin token checked and the request decoded (api/admin.py)."""
        self.admin.check(dict(context.invocation_metadata() or ()).get("authorization"))
        if isinstance(request, Undecodable):
            raise InvalidRequestError("request", request.error)
        return request

    async def load_adapter(self, request: pb.LoadAdapterRequest | Undecodable,
                           context: grpc.aio.ServicerContext) -> pb.AdapterInfo:
        try:
            req = self._admin(request, context)
            return adapter_proto(await self.admin.load(req.name, req.path, GRPC_FIELDS))
        except Exception as e:
            await self._fail(context, e)
            raise AssertionError("unreachable: abort raises") from e

    async def unload_adapter(self, request: pb.UnloadAdapterRequest | Undecodable,
                             context: grpc.aio.ServicerContext) -> pb.AdapterInfo:
        try:
            req = self._admin(request, context)
            if not req.name:
                raise InvalidRequestError("name", "is required: the adapter's name")
            return adapter_proto(self.admin.unload(req.name))
        except Exception as e:
            await self._fail(context, e)
            raise AssertionError("unreachable: abort raises") from e

    async def list_adapters(self, request: pb.ListAdaptersRequest | Undecodable,
                            context: grpc.aio.ServicerContext) -> pb.ListAdaptersResponse:
        try:
            self._admin(request, context)
            return pb.ListAdaptersResponse(adapters=[adapter_proto(a) for a in self.admin.list()])
        except Exception as e:
            await self._fail(context, e)
            raise AssertionError("unreachable: abort raises") from e

    def handler(self) -> grpc.GenericRpcHandler:
        ser = _serialize
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.generate, request_deserializer=_decoder(pb.GenerateRequest), response_serializer=ser),
            "Tokenize": grpc.unary_unary_rpc_method_handler(
                self.tokenize, request_deserializer=_decoder(pb.TokenizeRequest), response_serializer=ser),
            "ListModels": grpc.unary_unary_rpc_method_handler(
                self.list_models, request_deserializer=_decoder(pb.ListModelsRequest), response_serializer=ser),
            "LoadAdapter": grpc.unary_unary_rpc_method_handler(
                self.load_adapter, request_deserializer=_decoder(pb.LoadAdapterRequest), response_serializer=ser),
            "UnloadAdapter": grpc.unary_unary_rpc_method_handler(
                self.unload_adapter, request_deserializer=_decoder(pb.UnloadAdapterRequest), response_serializer=ser),
            "ListAdapters": grpc.unary_unary_rpc_method_handler(
                self.list_adapters, request_deserializer=_decoder(pb.ListAdaptersRequest), response_serializer=ser),
        })


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


def _tokenize(request: pb.TokenizeRequest, backend: Any, limits: Any) -> list[int]:
    has_text, has_messages = request.HasField("text"), bool(request.messages)
    if has_text == has_messages:
        raise InvalidRequestError("text", "give exactly one of text, messages")
    tok = backend.tokenizer
    if has_text:
        return tok.encode(request.text)
    spec = RequestSpec(messages=[{"role": m.role, "content": m.content} for m in request.messages])
    return tok.encode(tok.apply_chat_template(check_messages(spec, limits)))


@dataclass(frozen=True, slots=True)
class GrpcTls:
    cert_chain: bytes
    private_key: bytes


def build_server(door: FrontDoor, health_servicer: health.aio.HealthServicer) -> grpc.aio.Server:
    """A grpc.aio server with Generation, health and reflection (no port bound yet)."""
    size = door.limits.max_request_bytes
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", size),
                                      ("grpc.max_send_message_length", 64 * 2**20),
                                      ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((GenerationService(door).handler(),))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    return server


def bind(server: grpc.aio.Server, address: str, tls: GrpcTls | None) -> int:
    """Bind `address` ("host:port", port 0 = any); returns the port. Raises OSError when busy."""
    try:
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            creds = grpc.ssl_server_credentials([(tls.private_key, tls.cert_chain)])
            port = server.add_secure_port(address, creds)
    except RuntimeError as e:  # grpc raises this when the port is taken
        raise OSError(f"cannot bind gRPC to {address}: {e}") from e
    if port == 0:
        raise OSError(f"cannot bind gRPC to {address} (in use?)")
    return port


async def set_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE):
        await health_servicer.set(name, status)
