"""The Halfmoon Python SDK: a typed client of the gRPC API `halfmoon.v1.Generation`.

    from halfmoon.client import Client

    with Client("localhost:50051") as client:
        print(client.generate("The capital of France is", max_tokens=16).text)
        for chunk in client.stream(messages=[{"role": "user", "content": "Hi!"}]):
            print(chunk.text, end="", flush=True)   # the last chunk also carries `chunk.result`

`AsyncClient` has the same API on `grpc.aio` (`async with`, `await`, `async for`). Every failed
call raises one `APIError` subclass per gRPC status, with the server's details decoded
(`field`, `retry_after_s`, `reason`, `prediction`). Calls that fail with UNAVAILABLE are retried
with exponential backoff and jitter, at most `max_retries` times; a request the server rejected
up front (`ResourceExhaustedError` with `rejected` set: a predicted SLO miss, a full queue) is
retried after the server's Retry-After hint only when `retry_rejected` > 0. A stream is retried
only while it has not delivered anything (tokens are never asked for twice). A request names its
priority class with `priority_class=` ("interactive", "standard", "batch"); an admitted one's
result carries what admission predicted for it (`result.prediction`).

The admin API (LoRA adapters while serving: `load_adapter`, `unload_adapter`, `adapters`) takes an
admin token: `admin_token` / `admin_token_file` / $HALFMOON_ADMIN_TOKEN, else the API token. A
loaded adapter is a model like the base: `generate(..., model="my-adapter")`.

Both clients share everything but the I/O (`_ClientBase`): requests are built and responses read
in `halfmoon.messages`, the retry policy is `halfmoon.retry`; results and errors are in
`halfmoon.results` and `halfmoon.errors`, all re-exported here.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple, Self

import grpc

from halfmoon.core.errors import ConfigError
from halfmoon.errors import (ERRORS, APIError, CancelledError, DeadlineExceededError, FailedPreconditionError,
                             InternalError, InvalidArgumentError, NotFoundError, PermissionDeniedError,
                             ResourceExhaustedError, UnauthenticatedError, UnavailableError, api_error,
                             error_from_rpc)
from halfmoon.messages import (Collector, GenerateOptions, adapter_info, generate_request, model_info,
                               tokenize_request)
from halfmoon.results import (AdapterInfo, GenerationResult, ModelInfo, SloPrediction, StreamChunk, Timings,
                              ToolCall, Usage)
from halfmoon.retry import MAX_BACKOFF_S, Attempts, RetryEvent, RetryHook, RetryPolicy
from halfmoon.v1 import generation_pb2 as pb
from halfmoon.v1 import generation_pb2_grpc

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "ADMIN_TOKEN_ENV", "DEFAULT_TARGET", "ERRORS", "MAX_BACKOFF_S", "TOKEN_ENV", "APIError", "AdapterInfo",
    "AsyncClient",
    "CancelledError", "Client", "DeadlineExceededError", "FailedPreconditionError", "GenerateOptions",
    "GenerationResult", "InternalError", "InvalidArgumentError", "ModelInfo", "NotFoundError",
    "PermissionDeniedError", "ResourceExhaustedError",
    "RetryEvent", "RetryHook", "RetryPolicy", "SloPrediction", "StreamChunk", "Timings", "ToolCall",
    "UnauthenticatedError",
    "UnavailableError", "Usage", "api_error", "error_from_rpc", "generate_request", "resolve_token",
    "tokenize_request",
]

TOKEN_ENV = "HALFMOON_API_TOKEN"
ADMIN_TOKEN_ENV = "HALFMOON_ADMIN_TOKEN"
DEFAULT_TARGET = "localhost:50051"


@dataclass(frozen=True, slots=True)
class _Connection:
    """What both clients derive from their arguments."""

    target: str
    credentials: grpc.ChannelCredentials | None
    metadata: tuple[tuple[str, str], ...]
    options: tuple[tuple[str, Any], ...]
    admin_metadata: tuple[tuple[str, str], ...] = ()  # the admin API's calls


def resolve_token(token: str | None, token_file: str | os.PathLike[str] | None, env: str = TOKEN_ENV,
                  what: str = "API") -> str | None:
    """`token`, else the first non-empty, non-comment line of `token_file`, else $`env`
    ($HALFMOON_API_TOKEN); `what` names the token in errors."""
    if token:
        return token.strip()
    if token_file is not None:
        try:
            lines = Path(token_file).read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"cannot read the {what} token file {token_file}: {e}") from e
        for line in lines:
            if line.strip() and not line.strip().startswith("#"):
                return line.strip()
        raise ConfigError(f"the {what} token file {token_file} holds no token")
    return os.environ.get(env, "").strip() or None


def _bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def _connection(target: str, token: str | None, token_file: str | os.PathLike[str] | None, tls: bool,
                root_certificates: bytes | None, policy: RetryPolicy, admin_token: str | None = None,
                admin_token_file: str | os.PathLike[str] | None = None) -> _Connection:
    bearer = resolve_token(token, token_file)
    admin = resolve_token(admin_token, admin_token_file, ADMIN_TOKEN_ENV, "admin") or bearer
    metadata = _bearer(bearer)
    credentials = grpc.ssl_channel_credentials(root_certificates) if tls or root_certificates else None
    # Reconnect at least as often as we retry: with grpc's default (1 s, growing), a retry
    # sooner than that fails at once (channel in TRANSIENT_FAILURE) without trying to connect.
    # Our shortest pause is backoff_s / 2.
    options = (("grpc.initial_reconnect_backoff_ms", max(1, int(policy.backoff_s * 500))),
               ("grpc.max_reconnect_backoff_ms", max(1, int(policy.max_backoff_s * 1e3))),
               ("grpc.max_receive_message_length", 64 * 2**20))
    return _Connection(target, credentials, metadata, options, _bearer(admin))


class _Unary(NamedTuple):
    """One unary call, the same for both clients: the stub's method, the request, and how the
    response becomes the caller's result."""

    method: Any
    request: Any
    parse: Callable[[Any], Any]
    admin: bool = False  # an admin RPC: sent with the admin token


class _ClientBase:
    """Arguments, channel, stub, retries and the unary calls' messages of both clients; a
    subclass says which gRPC flavour opens the channel (`_channels`) and does the I/O."""

    _channels: ModuleType  # grpc or grpc.aio: both have insecure_channel / secure_channel

    def __init__(self, target: str = DEFAULT_TARGET, *, token: str | None = None,
                 token_file: str | os.PathLike[str] | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, timeout: float | None = None,
                 max_retries: int = 3, backoff_s: float = 0.2, retry_rejected: int = 0,
                 on_retry: RetryHook | None = None, admin_token: str | None = None,
                 admin_token_file: str | os.PathLike[str] | None = None) -> None:
        self.target = target
        self.timeout = timeout
        self.policy = RetryPolicy(max_retries, backoff_s, retry_rejected=retry_rejected)
        self.on_retry = on_retry
        self._rng = random.Random()
        c = self._conn = _connection(target, token, token_file, tls, root_certificates, self.policy,
                                     admin_token, admin_token_file)
        self._channel = (self._channels.insecure_channel(c.target, c.options) if c.credentials is None
                         else self._channels.secure_channel(c.target, c.credentials, c.options))
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def _attempts(self, timeout: float | None) -> Attempts:
        return Attempts(self.policy, self.timeout if timeout is None else timeout, self.on_retry, self._rng)

    def _open_stream(self, request: pb.GenerateRequest, attempts: Attempts) -> Any:
        """The Generate call of one attempt (an iterator of responses, sync or async)."""
        return self._stub.Generate(request, timeout=attempts.timeout(), metadata=self._conn.metadata)

    def _call(self, unary: _Unary, attempts: Attempts) -> Any:
        """One attempt of a unary call (its response, or an awaitable of it)."""
        metadata = self._conn.admin_metadata if unary.admin else self._conn.metadata
        return unary.method(unary.request, timeout=attempts.timeout(), metadata=metadata)

    def _tokenize(self, text: str | None, messages: Sequence[Mapping[str, str]] | None, model: str) -> _Unary:
        request = tokenize_request(text, messages=messages, model=model)
        return _Unary(self._stub.Tokenize, request, lambda response: list(response.token_ids))

    def _models(self) -> _Unary:
        return _Unary(self._stub.ListModels, pb.ListModelsRequest(),
                      lambda response: [model_info(m) for m in response.models])

    def _load_adapter(self, name: str, path: str | os.PathLike[str]) -> _Unary:
        return _Unary(self._stub.LoadAdapter, pb.LoadAdapterRequest(name=name, path=os.fspath(path)),
                      adapter_info, admin=True)

    def _unload_adapter(self, name: str) -> _Unary:
        return _Unary(self._stub.UnloadAdapter, pb.UnloadAdapterRequest(name=name), adapter_info, admin=True)

    def _adapters(self) -> _Unary:
        return _Unary(self._stub.ListAdapters, pb.ListAdaptersRequest(),
                      lambda response: [adapter_info(a) for a in response.adapters], admin=True)


class Client(_ClientBase):
    """A blocking client; thread-safe, one HTTP/2 connection. Use as a context manager or `close()`.

    target: "host:port". token / token_file / $HALFMOON_API_TOKEN: the bearer token (first found).
    admin_token / admin_token_file / $HALFMOON_ADMIN_TOKEN: the admin API's (default: the bearer token).
    tls: connect with TLS; root_certificates: PEM CA bundle (None = the system's; implies TLS).
    timeout: default deadline of every call in seconds (None = none); a call's `timeout` wins.
    max_retries / backoff_s: retries on UNAVAILABLE (see `RetryPolicy`); retry_rejected: retries
    of a rejected request, each after the server's Retry-After (default 0: a rejection raises at
    once); on_retry(RetryEvent) is called before each retry.
    """

    _channels = grpc

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

    def _stream(self, request: pb.GenerateRequest, attempts: Attempts) -> Iterator[StreamChunk]:
        while True:
            collector = Collector()
            call = self._open_stream(request, attempts)
            try:
                for response in call:
                    yield collector.add(response)
                collector.finish()
                return
            except grpc.RpcError as e:
                delay = attempts.failed(e, collector.received)
            finally:
                call.cancel()  # no-op once finished; stops the server's work if we were closed early
            time.sleep(delay)

    def tokenize(self, text: str | None = None, *, messages: Sequence[Mapping[str, str]] | None = None,
                 model: str = "", timeout: float | None = None) -> list[int]:
        """The token ids of `text`, or of `messages` rendered with the model's chat template."""
        return self._unary(self._tokenize(text, messages, model), timeout)

    def models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """The models this endpoint serves: the base model, then each LoRA adapter (`parent` set)."""
        return self._unary(self._models(), timeout)

    def load_adapter(self, name: str, path: str | os.PathLike[str], *, timeout: float | None = None) -> AdapterInfo:
        """Serve the PEFT LoRA adapter in folder `path` (as the server sees it) as model `name`
        (admin). InvalidArgumentError names why it cannot be served."""
        return self._unary(self._load_adapter(name, path), timeout)

    def unload_adapter(self, name: str, *, timeout: float | None = None) -> AdapterInfo:
        """Stop serving adapter `name` (admin); NotFoundError when it is not loaded."""
        return self._unary(self._unload_adapter(name), timeout)

    def adapters(self, *, timeout: float | None = None) -> list[AdapterInfo]:
        """The loaded LoRA adapters, by name (admin)."""
        return self._unary(self._adapters(), timeout)

    def _unary(self, unary: _Unary, timeout: float | None) -> Any:
        attempts = self._attempts(timeout)
        while True:
            try:
                return unary.parse(self._call(unary, attempts))
            except grpc.RpcError as e:
                delay = attempts.failed(e)
            time.sleep(delay)


class AsyncClient(_ClientBase):
    """`Client` on grpc.aio: create it in the event loop that uses it (`async with AsyncClient(...)`).
    `generate`, `tokenize`, `models`, the adapter calls and `close` are coroutines; `stream` is an async iterator
    (`async for`; wrap it in `contextlib.aclosing` to cancel promptly when leaving early)."""

    _channels = grpc.aio

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

    async def _stream(self, request: pb.GenerateRequest, attempts: Attempts) -> AsyncIterator[StreamChunk]:
        while True:
            collector = Collector()
            call = self._open_stream(request, attempts)
            try:
                async for response in call:
                    yield collector.add(response)
                collector.finish()
                return
            except grpc.RpcError as e:
                delay = attempts.failed(e, collector.received)
            finally:
                call.cancel()
            await asyncio.sleep(delay)

    async def tokenize(self, text: str | None = None, *, messages: Sequence[Mapping[str, str]] | None = None,
                       model: str = "", timeout: float | None = None) -> list[int]:
        """The token ids of `text`, or of `messages` rendered with the model's chat template."""
        return await self._unary(self._tokenize(text, messages, model), timeout)

    async def models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """The models this endpoint serves: the base model, then each LoRA adapter (`parent` set)."""
        return await self._unary(self._models(), timeout)

    async def load_adapter(self, name: str, path: str | os.PathLike[str], *,
                           timeout: float | None = None) -> AdapterInfo:
        """Serve the PEFT LoRA adapter in folder `path` as model `name` (admin)."""
        return await self._unary(self._load_adapter(name, path), timeout)

    async def unload_adapter(self, name: str, *, timeout: float | None = None) -> AdapterInfo:
        """Stop serving adapter `name` (admin)."""
        return await self._unary(self._unload_adapter(name), timeout)

    async def adapters(self, *, timeout: float | None = None) -> list[AdapterInfo]:
        """The loaded LoRA adapters, by name (admin)."""
        return await self._unary(self._adapters(), timeout)

    async def _unary(self, unary: _Unary, timeout: float | None) -> Any:
        attempts = self._attempts(timeout)
        while True:
            try:
                return unary.parse(await self._call(unary, attempts))
            except grpc.RpcError as e:
                delay = attempts.failed(e)
            await asyncio.sleep(delay)
