"""The Halfmoon Python SDK: a typed client of the gRPC API `halfmoon.v1.Generation`.

    from halfmoon.client import Client

    with Client("localhost:50051") as client:
        print(client.generate("The capital of France is", max_tokens=16).text)
        for chunk in client.stream(messages=[{"role": "user", "content": "Hi!"}]):
            print(chunk.text, end="", flush=True)   # the last chunk also carries `chunk.result`

`AsyncClient` has the same API on `grpc.aio` (`async with`, `await`, `async for`). Every failed
call raises one `APIError` subclass per gRPC status, with the server's details decoded
(`field`, `retry_after_s`, `prediction`). Calls that fail with UNAVAILABLE are retried with
exponential backoff and jitter, at most `max_retries` times; a stream only while it has not
delivered anything (tokens are never asked for twice).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Self, TypedDict

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from core.errors import ConfigError
from halfmoon.v1 import generation_pb2 as pb
from halfmoon.v1 import generation_pb2_grpc

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger(__name__)

TOKEN_ENV = "HALFMOON_API_TOKEN"
DEFAULT_TARGET = "localhost:50051"
MAX_BACKOFF_S = 10.0
_FINISH = MappingProxyType({pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                            pb.FINISH_REASON_ABORT: "abort"})


# ---------------------------------------------------------------------------------- results

@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_prompt_tokens: int  # served from the KV cache, not computed
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Timings:
    """Server-side milliseconds: queue, prefill, KV transfer, time to first token, mean time
    per output token after the first, end to end."""

    queue_ms: float
    prefill_ms: float
    transfer_ms: float
    ttft_ms: float
    mean_tpot_ms: float
    e2e_ms: float


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """A finished generation. `finish_reason` is "stop", "length" or "abort"; `stop` is the
    stop string that ended it, if one did."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    stop: str | None
    usage: Usage
    timings: Timings


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """New tokens of a stream; the last chunk has `result` set (and may have no tokens)."""

    request_id: str
    token_ids: list[int]
    text: str
    result: GenerationResult | None = None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    id: str
    max_model_len: int
    vocab_size: int
    owned_by: str


# ---------------------------------------------------------------------------------- errors

class APIError(Exception):
    """A call failed with gRPC status `code` (never OK).

    field: the request field at fault (google.rpc.BadRequest), e.g. "sampling.top_p".
    retry_after_s: how long the server asks to wait before retrying (google.rpc.RetryInfo).
    prediction: for a predicted SLO miss, the server's `SloPrediction` as a dict.
    reason: the machine-readable cause of a rejection (google.rpc.ErrorInfo), e.g. "OverloadedError".
    """

    def __init__(self, code: grpc.StatusCode, message: str, *, field: str | None = None,
                 retry_after_s: float | None = None, prediction: dict[str, float] | None = None,
                 reason: str | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s
        self.prediction = prediction
        self.reason = reason


class InvalidArgumentError(APIError):
    """A request field is invalid (`field` names it)."""


class NotFoundError(APIError):
    """The model is not served by this endpoint."""


class ResourceExhaustedError(APIError):
    """Overload, a limit, or a predicted SLO miss; retry after `retry_after_s` if given."""


class UnavailableError(APIError):
    """The server cannot be reached or cannot serve now (retried with backoff before raising)."""


class DeadlineExceededError(APIError):
    """The call's deadline passed; the server stopped the work."""


class CancelledError(APIError):
    """The call was cancelled; the server stopped the work."""


class UnauthenticatedError(APIError):
    """Missing or wrong bearer token."""


class InternalError(APIError):
    """A bug in the server (or a reply that breaks the protocol)."""


ERRORS: Mapping[grpc.StatusCode, type[APIError]] = MappingProxyType({
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.INTERNAL: InternalError,
})


def api_error(code: grpc.StatusCode, message: str, **details: Any) -> APIError:
    """The `APIError` subclass for `code` (plain `APIError` for codes without one)."""
    return ERRORS.get(code, APIError)(code, message, **details)


def error_from_rpc(error: grpc.RpcError) -> APIError:
    """Decode a failed call (sync or aio), including its google.rpc.Status details."""
    code, message = error.code(), error.details() or ""  # type: ignore[attr-defined]
    try:
        status = rpc_status.from_call(error)
    except ValueError:  # details inconsistent with the status: keep the status alone
        status = None
    details: dict[str, Any] = {}
    for any_detail in status.details if status is not None else ():
        details.update(_decode_detail(any_detail))
    return api_error(code, message, **details)


def _decode_detail(any_detail: Any) -> dict[str, Any]:
    if any_detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
        bad = error_details_pb2.BadRequest()
        any_detail.Unpack(bad)
        return {"field": bad.field_violations[0].field} if bad.field_violations else {}
    if any_detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
        info = error_details_pb2.RetryInfo()
        any_detail.Unpack(info)
        return {"retry_after_s": info.retry_delay.ToTimedelta().total_seconds()}
    if any_detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
        info = error_details_pb2.ErrorInfo()
        any_detail.Unpack(info)
        return {"reason": info.reason or None}
    if any_detail.Is(pb.SloPrediction.DESCRIPTOR):
        p = pb.SloPrediction()
        any_detail.Unpack(p)
        return {"prediction": {f.name: getattr(p, f.name) for f in p.DESCRIPTOR.fields}}
    return {}  # a detail this client does not know: ignored


# ---------------------------------------------------------------------------------- requests

class GenerateOptions(TypedDict, total=False):
    """The keyword arguments of `generate` / `stream` (see `generate_request`)."""

    messages: Sequence[Mapping[str, str]] | None
    prompt_token_ids: Sequence[int] | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    ttft_slo_ms: float | None
    tbt_slo_ms: float | None
    priority: int
    cache_salt: str | None
    request_id: str | None
    model: str


def generate_request(prompt: str | None = None, *, messages: Sequence[Mapping[str, str]] | None = None,
                     prompt_token_ids: Sequence[int] | None = None, max_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None,
                     top_k: int | None = None, seed: int | None = None, stop: Sequence[str] = (),
                     stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                     ttft_slo_ms: float | None = None, tbt_slo_ms: float | None = None,
                     priority: int = 0, cache_salt: str | None = None, request_id: str | None = None,
                     model: str = "") -> pb.GenerateRequest:
    """The `GenerateRequest` for these arguments; None = the server's default. Give exactly one
    of `prompt`, `messages` (`{"role", "content"}` dicts) and `prompt_token_ids` (the server
    checks, naming the field)."""
    sampling = pb.SamplingParams(**_present(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed))
    return pb.GenerateRequest(
        model=model, messages=_chat(messages), prompt_token_ids=list(prompt_token_ids or ()),
        sampling=sampling, slo=pb.Slo(**_present(ttft_ms=ttft_slo_ms, tbt_ms=tbt_slo_ms)),
        stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
        priority=priority, cache_salt=cache_salt or "", request_id=request_id or "",
        **_present(prompt=prompt, max_tokens=max_tokens))


def tokenize_request(text: str | None = None, *, messages: Sequence[Mapping[str, str]] | None = None,
                     model: str = "") -> pb.TokenizeRequest:
    return pb.TokenizeRequest(model=model, messages=_chat(messages), **_present(text=text))


def _present(**fields: Any) -> dict[str, Any]:
    """The fields that were given (proto3 `optional` fields stay unset otherwise)."""
    return {k: v for k, v in fields.items() if v is not None}


def _chat(messages: Sequence[Mapping[str, str]] | None) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role=m.get("role", ""), content=m.get("content", "")) for m in messages or ()]


# ---------------------------------------------------------------------------------- streams

class _Collector:
    """Turns the responses of one Generate call into chunks and, at the end, the result."""

    __slots__ = ("received", "request_id", "result", "texts", "token_ids")

    def __init__(self) -> None:
        self.request_id = ""
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.received = 0  # messages delivered to the caller (a stream is retried only at 0)
        self.result: GenerationResult | None = None

    def add(self, response: pb.GenerateResponse) -> StreamChunk:
        self.received += 1
        self.request_id = response.request_id or self.request_id
        ids = list(response.token_ids)
        self.token_ids.extend(ids)
        self.texts.append(response.text)
        if response.HasField("final"):
            self.result = self._result(response.final)
        return StreamChunk(self.request_id, ids, response.text, self.result)

    def finish(self) -> GenerationResult:
        """The result; raises InternalError when the stream ended without its final message."""
        if self.result is None:
            raise InternalError(grpc.StatusCode.INTERNAL, "the stream ended without its final message")
        return self.result

    def _result(self, final: pb.Final) -> GenerationResult:
        if final.finish_reason not in _FINISH:
            raise InternalError(grpc.StatusCode.INTERNAL, f"unknown finish reason {final.finish_reason}")
        u, t = final.usage, final.timings
        return GenerationResult(
            self.request_id, "".join(self.texts), list(self.token_ids), _FINISH[final.finish_reason],
            final.stop or None, Usage(u.prompt_tokens, u.cached_prompt_tokens, u.completion_tokens),
            Timings(t.queue_ms, t.prefill_ms, t.transfer_ms, t.ttft_ms, t.mean_tpot_ms, t.e2e_ms))


def _model_info(m: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(m.id, m.max_model_len, m.vocab_size, m.owned_by)


# ---------------------------------------------------------------------------------- retries

@dataclass(frozen=True, slots=True)
class RetryEvent:
    """Passed to `on_retry` before the pause: the `retry`-th retry (1-based) of a call comes
    after `delay_s` seconds because of `error`."""

    retry: int
    delay_s: float
    error: APIError


RetryHook = Callable[[RetryEvent], None]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retry UNAVAILABLE only, at most `max_retries` times, after `backoff_s * 2**n` seconds
    (n = retries so far, capped at `max_backoff_s`) with +-50% jitter."""

    max_retries: int = 3
    backoff_s: float = 0.2
    max_backoff_s: float = MAX_BACKOFF_S

    def __post_init__(self) -> None:
        if self.max_retries < 0 or not self.backoff_s >= 0:
            raise ConfigError(f"max_retries and backoff_s must be >= 0, got {self.max_retries}, {self.backoff_s}")

    def should_retry(self, error: APIError, retries: int, received: int) -> bool:
        """Whether a call that failed with `error` after `retries` retries, having delivered
        `received` messages, may be sent again. Never after a stream delivered tokens."""
        return error.code is grpc.StatusCode.UNAVAILABLE and retries < self.max_retries and received == 0

    def delay_s(self, retries: int, rng: random.Random) -> float:
        base = min(self.max_backoff_s, self.backoff_s * 2**retries)
        return base * (0.5 + rng.random())


class _Attempts:
    """The attempts of one call: its deadline across retries, and the pause before each retry."""

    __slots__ = ("deadline", "on_retry", "policy", "retries", "rng")

    def __init__(self, policy: RetryPolicy, timeout: float | None, on_retry: RetryHook | None,
                 rng: random.Random) -> None:
        self.policy = policy
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.on_retry = on_retry
        self.rng = rng
        self.retries = 0

    def timeout(self) -> float | None:
        """Seconds left for the next attempt (None = no deadline)."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceededError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        "the call's deadline passed while retrying")
        return left

    def backoff(self, error: APIError, received: int = 0) -> float:
        """The pause before the next attempt; raises `error` when the call must not be retried."""
        if not self.policy.should_retry(error, self.retries, received):
            raise error
        delay = self.policy.delay_s(self.retries, self.rng)
        if error.retry_after_s is not None:
            delay = max(delay, error.retry_after_s)
        if self.deadline is not None and time.monotonic() + delay >= self.deadline:
            raise error  # the retry could not finish in time: report why the last attempt failed
        self.retries += 1
        log.info("retry %d/%d in %.2f s after %s", self.retries, self.policy.max_retries, delay, error)
        if self.on_retry is not None:
            self.on_retry(RetryEvent(self.retries, delay, error))
        return delay


# ---------------------------------------------------------------------------------- clients

@dataclass(frozen=True, slots=True)
class _Connection:
    """What both clients derive from their arguments."""

    target: str
    credentials: grpc.ChannelCredentials | None
    metadata: tuple[tuple[str, str], ...]
    options: tuple[tuple[str, Any], ...]


def resolve_token(token: str | None, token_file: str | os.PathLike[str] | None) -> str | None:
    """`token`, else the first non-empty, non-comment line of `token_file`, else $HALFMOON_API_TOKEN."""
    if token:
        return token.strip()
    if token_file is not None:
        try:
            lines = Path(token_file).read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"cannot read the API token file {token_file}: {e}") from e
        for line in lines:
            if line.strip() and not line.strip().startswith("#"):
                return line.strip()
        raise ConfigError(f"the API token file {token_file} holds no token")
    return os.environ.get(TOKEN_ENV, "").strip() or None


def _connection(target: str, token: str | None, token_file: str | os.PathLike[str] | None, tls: bool,
                root_certificates: bytes | None, policy: RetryPolicy) -> _Connection:
    bearer = resolve_token(token, token_file)
    metadata = (("authorization", f"Bearer {bearer}"),) if bearer else ()
    credentials = grpc.ssl_channel_credentials(root_certificates) if tls or root_certificates else None
    # Reconnect at least as often as we retry: with grpc's default (1 s, growing), a retry
    # sooner than that fails at once (channel in TRANSIENT_FAILURE) without trying to connect.
    # Our shortest pause is backoff_s / 2.
    options = (("grpc.initial_reconnect_backoff_ms", max(1, int(policy.backoff_s * 500))),
               ("grpc.max_reconnect_backoff_ms", max(1, int(policy.max_backoff_s * 1e3))),
               ("grpc.max_receive_message_length", 64 * 2**20))
    return _Connection(target, credentials, metadata, options)


class _ClientBase:
    def __init__(self, target: str, *, token: str | None, token_file: str | os.PathLike[str] | None,
                 tls: bool, root_certificates: bytes | None, timeout: float | None, max_retries: int,
                 backoff_s: float, on_retry: RetryHook | None) -> None:
        self.target = target
        self.timeout = timeout
        self.policy = RetryPolicy(max_retries, backoff_s)
        self.on_retry = on_retry
        self._rng = random.Random()
        self._conn = _connection(target, token, token_file, tls, root_certificates, self.policy)

    def _attempts(self, timeout: float | None) -> _Attempts:
        return _Attempts(self.policy, self.timeout if timeout is None else timeout, self.on_retry, self._rng)


class Client(_ClientBase):
    """A blocking client; thread-safe, one HTTP/2 connection. Use as a context manager or `close()`.

    target: "host:port". token / token_file / $HALFMOON_API_TOKEN: the bearer token (first found).
    tls: connect with TLS; root_certificates: PEM CA bundle (None = the system's; implies TLS).
    timeout: default deadline of every call in seconds (None = none); a call's `timeout` wins.
    max_retries / backoff_s: retries on UNAVAILABLE (see `RetryPolicy`); on_retry(RetryEvent)
    is called before each retry.
    """

    def __init__(self, target: str = DEFAULT_TARGET, *, token: str | None = None,
                 token_file: str | os.PathLike[str] | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, timeout: float | None = None,
                 max_retries: int = 3, backoff_s: float = 0.2, on_retry: RetryHook | None = None) -> None:
        super().__init__(target, token=token, token_file=token_file, tls=tls,
                         root_certificates=root_certificates, timeout=timeout, max_retries=max_retries,
                         backoff_s=backoff_s, on_retry=on_retry)
        c = self._conn
        self._channel = (grpc.insecure_channel(c.target, c.options) if c.credentials is None
                         else grpc.secure_channel(c.target, c.credentials, c.options))
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection; calls in flight are cancelled."""
        self._channel.close()

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **options: Unpack[GenerateOptions]) -> GenerationResult:
        """Generate to the end and return the result (options: see `generate_request`)."""
        result = None
        for chunk in self.stream(prompt, timeout=timeout, **options):
            result = chunk.result or result
        assert result is not None  # the stream raises when its final message is missing
        return result

    def stream(self, prompt: str | None = None, *, timeout: float | None = None,
               **options: Unpack[GenerateOptions]) -> Iterator[StreamChunk]:
        """Stream the tokens as they are sampled; the last chunk carries the result. Closing the
        iterator early cancels the request on the server."""
        return self._stream(generate_request(prompt, **options), self._attempts(timeout))

    def _stream(self, request: pb.GenerateRequest, attempts: _Attempts) -> Iterator[StreamChunk]:
        while True:
            collector = _Collector()
            call = self._stub.Generate(request, timeout=attempts.timeout(), metadata=self._conn.metadata)
            try:
                for response in call:
                    yield collector.add(response)
                collector.finish()
                return
            except grpc.RpcError as e:
                delay = attempts.backoff(error_from_rpc(e), collector.received)
            finally:
                call.cancel()  # no-op once finished; stops the server's work if we were closed early
            time.sleep(delay)

    def tokenize(self, text: str | None = None, *, messages: Sequence[Mapping[str, str]] | None = None,
                 model: str = "", timeout: float | None = None) -> list[int]:
        """The token ids of `text`, or of `messages` rendered with the model's chat template."""
        request = tokenize_request(text, messages=messages, model=model)
        return list(self._unary(self._stub.Tokenize, request, timeout).token_ids)

    def models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """The models this endpoint serves."""
        response = self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        return [_model_info(m) for m in response.models]

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        attempts = self._attempts(timeout)
        while True:
            try:
                return method(request, timeout=attempts.timeout(), metadata=self._conn.metadata)
            except grpc.RpcError as e:
                delay = attempts.backoff(error_from_rpc(e))
            time.sleep(delay)


class AsyncClient(_ClientBase):
    """`Client` on grpc.aio: create it in the event loop that uses it (`async with AsyncClient(...)`).
    `generate`, `tokenize`, `models` and `close` are coroutines; `stream` is an async iterator
    (`async for`; wrap it in `contextlib.aclosing` to cancel promptly when leaving early)."""

    def __init__(self, target: str = DEFAULT_TARGET, *, token: str | None = None,
                 token_file: str | os.PathLike[str] | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, timeout: float | None = None,
                 max_retries: int = 3, backoff_s: float = 0.2, on_retry: RetryHook | None = None) -> None:
        super().__init__(target, token=token, token_file=token_file, tls=tls,
                         root_certificates=root_certificates, timeout=timeout, max_retries=max_retries,
                         backoff_s=backoff_s, on_retry=on_retry)
        c = self._conn
        self._channel = (grpc.aio.insecure_channel(c.target, c.options) if c.credentials is None
                         else grpc.aio.secure_channel(c.target, c.credentials, c.options))
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection; calls in flight are cancelled."""
        await self._channel.close()

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                       **options: Unpack[GenerateOptions]) -> GenerationResult:
        """Generate to the end and return the result (options: see `generate_request`)."""
        result = None
        async for chunk in self.stream(prompt, timeout=timeout, **options):
            result = chunk.result or result
        assert result is not None  # the stream raises when its final message is missing
        return result

    def stream(self, prompt: str | None = None, *, timeout: float | None = None,
               **options: Unpack[GenerateOptions]) -> AsyncIterator[StreamChunk]:
        """Stream the tokens as they are sampled; the last chunk carries the result."""
        return self._stream(generate_request(prompt, **options), self._attempts(timeout))

    async def _stream(self, request: pb.GenerateRequest, attempts: _Attempts) -> AsyncIterator[StreamChunk]:
        while True:
            collector = _Collector()
            call = self._stub.Generate(request, timeout=attempts.timeout(), metadata=self._conn.metadata)
            try:
                async for response in call:
                    yield collector.add(response)
                collector.finish()
                return
            except grpc.RpcError as e:
                delay = attempts.backoff(error_from_rpc(e), collector.received)
            finally:
                call.cancel()
            await asyncio.sleep(delay)

    async def tokenize(self, text: str | None = None, *, messages: Sequence[Mapping[str, str]] | None = None,
                       model: str = "", timeout: float | None = None) -> list[int]:
        """The token ids of `text`, or of `messages` rendered with the model's chat template."""
        request = tokenize_request(text, messages=messages, model=model)
        return list((await self._unary(self._stub.Tokenize, request, timeout)).token_ids)

    async def models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """The models this endpoint serves."""
        response = await self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        return [_model_info(m) for m in response.models]

    async def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        attempts = self._attempts(timeout)
        while True:
            try:
                return await method(request, timeout=attempts.timeout(), metadata=self._conn.metadata)
            except grpc.RpcError as e:
                delay = attempts.backoff(error_from_rpc(e))
            await asyncio.sleep(delay)
