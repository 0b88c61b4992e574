"""The OpenAI-compatible HTTP front door (FastAPI).

    POST /v1/completions, /v1/chat/completions   (SSE with "stream": true)
    GET  /v1/models, /health, /metrics
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter; GET /v1/lora_adapters   (admin: api/admin.py)

`/v1/*` needs the bearer token when auth is on; `/health` and `/metrics` never do (probes and
scrapers). A streamed request is validated and admitted before the response starts, so every
rejection is a plain HTTP error; once streaming, an error arrives as an SSE `error` event.
A client that disconnects stops its request (its KV is freed at the next engine step).
A rejection (admission, a client's stream limit) is a 429 with `Retry-After` (whole seconds) and
an error object that carries `reason`, `retry_after_s` and the predictions (api/rejection.py).
A request names its priority class in the body (`priority_class`) or the `X-Priority-Class` header.
A W3C `traceparent` header makes the request's trace a part of the client's (core/tracing.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from halfmoon.api import openai_schema as oa
from halfmoon.api.admin import AdapterAdmin, adapter_json, parse_load, parse_unload
from halfmoon.api.openapi import answer, json_body, operation, publish
from halfmoon.api.openapi_bodies import ref
from halfmoon.conductor.backend import GenerationBackend
from halfmoon.conductor.errors import RequestTooLargeError, RetryableRejection, status_of
from halfmoon.api.frontdoor import Call, FrontDoor
from halfmoon.api.logprobs_json import echo_logprobs, logprobs_json
from halfmoon.api.requests import RequestSpec
from halfmoon.api.rejection import retry_after_header
from halfmoon.api.tool_formats import ToolFormat
from halfmoon.api.tool_stream import ToolStream
from halfmoon.core.errors import HalfmoonError, InvalidRequestError
from halfmoon.core.messages import TokenChunk, TokenLogprobs
from halfmoon.core.tracing import TRACEPARENT
from halfmoon.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Items = AsyncIterator[TokenChunk]
PRIORITY_CLASS_HEADER = "X-Priority-Class"


_PROMETHEUS, _OPENMETRICS = "text/plain", "application/openmetrics-text"
_GENERATION_ERRORS = (400, 404, 429, 503)
# One Server-Sent Event of a stream (OpenAPI 3.1: the schema of an event stream is each event's).
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "event": {"const": "message"},
    "data": {"type": "string", "description": "a chunk (JSON), an error object (JSON) once streaming, or the "
                                              "last event, `[DONE]`"}}}


def _generated(schema: str) -> dict[str, Any]:
    """A generation's 200: the whole answer, or with stream: true an SSE stream of chunks."""
    return answer("the answer; with stream: true, Server-Sent Events (`data: {chunk}` ... `data: [DONE]`)",
                  {"content": {"application/json": {"schema": ref(schema)},
                               "text/event-stream": {"schema": _SSE_EVENT}}})


def error_response(error: BaseException) -> JSONResponse:
    st = status_of(error)
    if st.http == 500:
        log.error("internal error in an HTTP request", exc_info=error)
    headers = {}
    if isinstance(error, RetryableRejection):
        headers["Retry-After"] = retry_after_header(error)
    return JSONResponse(oa.error_json(error), status_code=st.http, headers=headers)


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is a 413 before anything parses it."""

    def __init__(self, app: Any, door: FrontDoor) -> None:
        self.app, self.door = app, door
        self.limit = door.limits.max_request_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            error = RequestTooLargeError(int(length), self.limit)
            self.door.count_error("http", error)
            return await error_response(error)(scope, receive, send)
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise RequestTooLargeError(seen, self.limit)
            return message

        return await self.app(scope, counted, send)


def build_app(door: FrontDoor) -> FastAPI:
    app = FastAPI(title="Halfmoon", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    publish(app, door)

    async def on_error(_request: Request, error: Exception) -> Response:
        door.count_error("http", error)
        return error_response(error)

    app.add_exception_handler(HalfmoonError, on_error)
    app.add_exception_handler(Exception, on_error)  # a bug: 500 in OpenAI's shape, logged

    async def client_of(request: Request) -> str:
        host = request.client.host if request.client else "unknown"
        return door.client(request.headers.get("authorization"), host)

    @app.get("/health", openapi_extra=operation("Is the server serving?", {
        200: answer("ok, or degraded (serving at less than full strength)", json_body(ref("Health"))),
        503: answer("unavailable", json_body(ref("Health")))}))
    async def health() -> Response:
        """ok (200); degraded (200: serving, at less than full strength, `reasons` say why);
        unavailable (503). With warm standbys (`--standby`): `standby` lists them and their state."""
        spares = door.backend.standbys()
        extra = {"standby": spares} if spares else {}
        if not door.backend.ready():
            return JSONResponse({"status": "unavailable", **extra}, status_code=503)
        reasons = door.backend.degraded()
        body = {"status": "degraded", "reasons": reasons} if reasons else {"status": "ok"}
        return JSONResponse({**body, **extra})

    @app.get("/metrics", openapi_extra=operation("Prometheus metrics", {200: answer(
        "Prometheus text, or OpenMetrics when the Accept header asks for it",
        {"content": {t: {"schema": {"type": "string"}} for t in (_PROMETHEUS, _OPENMETRICS)}})}))
    async def metrics(request: Request) -> Response:
        body, content_type = door.metrics.render(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/v1/models", openapi_extra=operation("The served model and its LoRA adapters", {
        200: answer("the base model, then each loaded LoRA adapter", json_body(ref("ModelList")))}, auth=True))
    async def models(request: Request) -> Response:
        await client_of(request)
        return JSONResponse({"object": "list", "data": model_cards(door.backend)})

    _admin_routes(app, door)

    @app.post("/v1/chat/completions", openapi_extra=operation(
        "A chat completion (SSE with stream: true)", {200: _generated("ChatCompletion")}, _GENERATION_ERRORS,
        body=json_body(ref("ChatCompletionRequest")), auth=True))
    async def chat(request: Request) -> Response:
        return await _serve(door, request, await client_of(request), oa.parse_chat, chat=True)

    @app.post("/v1/completions", openapi_extra=operation(
        "A text completion (SSE with stream: true)", {200: _generated("Completion")}, _GENERATION_ERRORS,
        body=json_body(ref("CompletionRequest")), auth=True))
    async def completions(request: Request) -> Response:
        return await _serve(door, request, await client_of(request), oa.parse_completion, chat=False)

    return app


def model_cards(backend: GenerationBackend) -> list[dict[str, Any]]:
    """/v1/models' entries: the base model, then each LoRA adapter (vLLM's: `root` its folder,
    `parent` the base model's id)."""
    m = backend.model
    base = {"id": m.id, "object": "model", "created": 0, "owned_by": m.owned_by, "max_model_len": m.max_model_len,
            "architecture": m.architecture, "dtype": m.dtype, "root": m.id, "parent": None}
    adapters = backend.adapters.list() if backend.adapters is not None else []
    return [base, *({**base, "id": a.name, "created": int(a.loaded_at), "root": a.path, "parent": m.id}
                    for a in adapters)]


def _admin_routes(app: FastAPI, door: FrontDoor) -> None:
    """The admin API's routes (api/admin.py): an admin token each, vLLM's paths and bodies."""
    admin = AdapterAdmin(door.backend, door.admin)
    adapter = answer("the adapter", json_body(ref("LoraAdapter")))

    @app.post("/v1/load_lora_adapter", openapi_extra=operation(
        "Serve a LoRA adapter (admin)", {200: adapter}, (400, 409),
        body=json_body(ref("LoadLoraAdapterRequest")), admin=True))
    async def load_lora_adapter(request: Request) -> Response:
        admin.check(request.headers.get("authorization"))
        name, path = parse_load(await _json_body(request))
        return JSONResponse(adapter_json(await admin.load(name, path)))

    @app.post("/v1/unload_lora_adapter", openapi_extra=operation(
        "Stop serving a LoRA adapter (admin)", {200: adapter}, (400, 404),
        body=json_body(ref("UnloadLoraAdapterRequest")), admin=True))
    async def unload_lora_adapter(request: Request) -> Response:
        admin.check(request.headers.get("authorization"))
        return JSONResponse(adapter_json(admin.unload(parse_unload(await _json_body(request)))))

    @app.get("/v1/lora_adapters", openapi_extra=operation("The loaded LoRA adapters (admin)", {
        200: answer("every loaded adapter, by name", json_body(ref("LoraAdapterList")))}, admin=True))
    async def lora_adapters(request: Request) -> Response:
        admin.check(request.headers.get("authorization"))
        return JSONResponse({"object": "list", "data": [adapter_json(a) for a in admin.list()]})


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise InvalidRequestError("body", f"not valid JSON: {e}") from e


async def _serve(door: FrontDoor, request: Request, client: str,
                 parse: Callable[[Any], tuple[Any, bool, bool]], chat: bool) -> Response:
    spec, stream, include_usage = parse(await _json_body(request))
    header = request.headers.get(PRIORITY_CLASS_HEADER)
    if spec.priority_class is None and header is not None:  # the body's field wins
        spec.priority_class = header.strip()
        spec.names = {**spec.names, "priority_class": PRIORITY_CLASS_HEADER}
    path = request.url.path
    call = Call(f"POST {path}", {"http.request.method": "POST", "url.path": path, "halfmoon.api": "http"},
                request.headers.get(TRACEPARENT))
    items = door.generate(spec, client, "http", call)
    # the model the answer names: the request's (a LoRA adapter's name, as vLLM answers), else the base
    model, tokenizer = spec.model or door.backend.model.id, door.backend.tokenizer
    fmt = door.tool_format if chat and spec.tools is not None and spec.tools.active else None
    if not stream:
        return await _until_disconnect(request, lambda: _collect(items, model, chat, tokenizer, spec, fmt))
    try:
        first = await items.__anext__()  # validation and admission happen here
    except BaseException:
        await items.aclose()
        raise
    # the prompt is valid once the first item came (validation happens before it)
    echo = Echo.of(spec, tokenizer) if spec.echo else None
    tools = [ToolStream(fmt) for _ in range(spec.n)] if fmt is not None else None
    events = _sse(door, first, items, Stream(model, chat, include_usage, tokenizer, echo=echo, tools=tools), spec.n)
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@dataclass(frozen=True, slots=True)
class Echo:
    """Completions' `echo`: the prompt's text and ids, which the answer starts with."""

    text: str
    ids: list[int]

    @classmethod
    def of(cls, spec: RequestSpec, tokenizer: Tokenizer) -> Echo:
        ids = spec.prompt_token_ids if spec.prompt_token_ids is not None else tokenizer.encode(spec.prompt or "")
        return cls(spec.prompt if spec.prompt is not None else tokenizer.decode(ids), list(ids))

    def logprobs(self, tokenizer: Tokenizer, prompt: Sequence[TokenLogprobs] | None, token_ids: Sequence[int],
                 logprobs: Sequence[TokenLogprobs] | None) -> dict[str, Any] | None:
        if prompt is None or logprobs is None:
            return None
        return echo_logprobs(tokenizer, self.ids, prompt, token_ids, logprobs)


@dataclass(slots=True)
class Choice:
    """One choice's chunks summed up, as a non-streaming answer gathers them."""

    texts: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish: str = ""

    def add(self, item: TokenChunk) -> None:
        self.texts.append(item.text)
        self.tokens.extend(item.token_ids)
        if item.logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *item.logprobs]
        ended = item.choice_finished
        if ended is not None:
            self.finish = ended.finish_reason.value


async def _collect(items: Items, model: str, chat: bool, tokenizer: Tokenizer, spec: RequestSpec,
                   fmt: ToolFormat | None = None) -> Response:
    choices = [Choice() for _ in range(spec.n)]
    prompt: tuple[TokenLogprobs, ...] | None = None
    async with aclosing(items):
        async for item in items:
            choices[item.index].add(item)
            prompt = prompt if prompt is not None else item.prompt_logprobs  # the first (a move sends none)
            if item.end is not None:
                echo = Echo.of(spec, tokenizer) if spec.echo else None  # validated: items came
                out = [_choice_json(i, c, chat, tokenizer, echo, prompt, fmt) for i, c in enumerate(choices)]
                return JSONResponse(oa.response_json(model, item.request_id, item.end, out, oa.now_s(), chat))
    raise AssertionError("a generation ended without its last chunk")


def _choice_json(index: int, c: Choice, chat: bool, tokenizer: Tokenizer, echo: Echo | None,
                 prompt: tuple[TokenLogprobs, ...] | None, fmt: ToolFormat | None = None) -> dict[str, Any]:
    lp = (echo.logprobs(tokenizer, prompt, c.tokens, c.logprobs) if echo is not None
          else logprobs_json(tokenizer, c.tokens, c.logprobs, chat))
    text = (echo.text if echo is not None else "") + "".join(c.texts)
    if fmt is None:
        return oa.choice_json(index, text, c.finish, chat, lp)
    parsed = fmt.parse(text)
    return oa.choice_json(index, parsed.content, oa.finish_with_calls(c.finish, bool(parsed.calls)), chat, lp,
                          parsed.calls)


async def _until_disconnect(request: Request, work: Callable[[], Awaitable[Response]]) -> Response:
    """Run `work`; if the client disconnects first, cancel it (which aborts the request)."""
    task = asyncio.ensure_future(work())

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        return Response(status_code=499)
    return task.result()


@dataclass(slots=True)
class Stream:
    """What a stream's chunks are made with; `offsets`: each choice's text sent so far
    (completions' text_offset)."""

    model: str
    chat: bool
    include_usage: bool
    tokenizer: Tokenizer
    offsets: list[int] = field(default_factory=lambda: [0])
    echo: Echo | None = None  # sent with the first chunk, then None
    tools: list[ToolStream] | None = None  # each choice's tool calls, when the request offers tools


async def _sse(door: FrontDoor, first: TokenChunk, items: Items, s: Stream, n: int = 1) -> AsyncIterator[bytes]:
    created = oa.now_s()
    rid = first.request_id
    s.offsets = [0] * n
    try:
        for index in range(n) if s.chat else ():
            yield _event(oa.stream_chunk(s.model, rid, created, True, {"role": "assistant", "content": ""},
                                         index=index))
        item: TokenChunk | None = first
        while item is not None:
            for chunk in _chunks(item, s, rid, created):
                yield _event(chunk)
            item = None if item.end is not None else await items.__anext__()
    except HalfmoonError as e:  # headers are sent: the error travels as an event
        door.count_error("http", e)
        yield _event(oa.error_json(e))
    finally:
        await items.aclose()
    yield b"data: [DONE]\n\n"


def _chunks(item: TokenChunk, s: Stream, rid: str, created: int) -> list[dict[str, Any]]:
    """A chunk's text and its tokens' logprobs (if any), then, on the last one, the finish
    reason and usage."""
    out = []
    if s.echo is not None:
        out += _echo_chunks(item, s, rid, created)
    i = item.index
    if item.text or item.logprobs:
        lp = logprobs_json(s.tokenizer, item.token_ids, item.logprobs, s.chat, s.offsets[i])
        s.offsets[i] += len(item.text)
        out += _content_chunks(item.text, lp, s, rid, created, i)
    ended = item.choice_finished
    if ended is not None:
        finish = ended.finish_reason.value
        if s.tools is not None:
            out += [oa.stream_chunk(s.model, rid, created, True, d, index=i) for d in s.tools[i].finish()]
            finish = oa.finish_with_calls(finish, s.tools[i].called)
        out.append(oa.stream_chunk(s.model, rid, created, s.chat, {} if s.chat else "", finish,
                                   prediction=item.end.prediction if item.end is not None else None, index=i))
    if item.end is not None:
        if s.include_usage:
            out.append(oa.stream_chunk(s.model, rid, created, s.chat, None, usage=oa.usage_json(item.end.usage)))
    return out


def _content_chunks(text: str, lp: dict[str, Any] | None, s: Stream, rid: str, created: int,
                    i: int) -> list[dict[str, Any]]:
    """A choice's new text as chunks: as it is, or split into content and tool calls (the
    tokens' logprobs ride on the first)."""
    if s.tools is None:
        return [oa.stream_chunk(s.model, rid, created, s.chat, {"content": text} if s.chat else text,
                                logprobs=lp, index=i)]
    deltas = s.tools[i].push(text)
    if not deltas and lp is not None:
        deltas = [{"content": ""}]
    return [oa.stream_chunk(s.model, rid, created, True, d, logprobs=lp if k == 0 else None, index=i)
            for k, d in enumerate(deltas)]


def _echo_chunks(item: TokenChunk, s: Stream, rid: str, created: int) -> list[dict[str, Any]]:
    """A stream with `echo` starts each choice with the prompt's text and (asked for) its
    tokens' logprobs (the request's first chunk carries them)."""
    assert s.echo is not None
    echo, s.echo = s.echo, None
    lp = echo.logprobs(s.tokenizer, item.prompt_logprobs, [], [] if item.prompt_logprobs is not None else None)
    out = []
    for i in range(len(s.offsets)):
        s.offsets[i] += len(echo.text)
        out.append(oa.stream_chunk(s.model, rid, created, False, echo.text, logprobs=lp, index=i))
    return out


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
