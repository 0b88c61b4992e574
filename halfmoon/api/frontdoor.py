"""What both APIs share: auth, the per-client stream limit, validation, the backend, metrics.

    door.client(authorization, peer)        -> client identity (or UnauthenticatedError)
    door.generate(spec, client, api, call)   -> async iterator of TokenChunk ..., the last with `end`

`call` names the incoming call for tracing (its span's name and attributes, the client's W3C
traceparent): each request is one span at the front door, the parent of everything the backend
and the workers trace for it (core/tracing.py), and the request's ids reach the logs.

Every request that reaches the backend is also counted in `door.live` (the dashboard's recent
history, conductor/live.py) and recorded in `door.traffic` (the Mooncake-format log the sizing
page replays), finished or rejected.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from functools import cached_property

from halfmoon.api.auth import Authenticator, StreamLimiter
from halfmoon.conductor.backend import GenerationBackend
from halfmoon.conductor.admission import resolve
from halfmoon.conductor.backend import GenerationInput
from halfmoon.conductor.errors import RetryableRejection, TooManyStreamsError, status_of
from halfmoon.conductor.live import LiveWindow, TrafficRecorder, meets
from halfmoon.api.metrics import Metrics
from halfmoon.api.tool_formats import AUTO, ToolFormat, choose
from halfmoon.api.requests import Limits, RequestSpec, build_input
from halfmoon.core.errors import InvalidRequestError
from halfmoon.core.logs import bind_request
from halfmoon.core.messages import RequestEnd, TokenChunk
from halfmoon.core.tracing import Attributes, Span


@dataclass(frozen=True, slots=True)
class Call:
    """An incoming call as tracing names it: the span's name, its attributes, and the client's
    W3C traceparent (None: the request starts a trace)."""

    name: str
    attributes: Attributes = field(default_factory=dict)
    traceparent: str | None = None


class FrontDoor:
    def __init__(self, backend: GenerationBackend, limits: Limits, auth: Authenticator,
                 tool_parser: str = AUTO, admin: Authenticator | None = None) -> None:
        """`auth`: the API tokens; `admin`: the admin API's (api/admin.py; None: none, it is closed)."""
        self.backend = backend
        self.tool_parser = tool_parser
        self.limits = limits
        self.auth = auth
        self.admin = admin if admin is not None else Authenticator([])
        self.limiter = StreamLimiter(limits.max_streams_per_client)
        self.metrics = Metrics(backend.stats)
        self.live = LiveWindow()
        self.traffic = TrafficRecorder()

    @cached_property
    def tool_format(self) -> ToolFormat:
        """How the served model writes tool calls (api/tool_formats.py)."""
        tokenizer = self.backend.tokenizer
        template = tokenizer.chat_template if tokenizer is not None else None
        return choose(template, self.backend.model.architecture, self.tool_parser)

    def client(self, authorization: str | None, peer: str) -> str:
        """Who is calling: their token's digest when auth is on, else their address."""
        return self.auth.check(authorization) or "peer:" + peer

    async def generate(self, spec: RequestSpec, client: str, api: str,
                       call: Call | None = None) -> AsyncIterator[TokenChunk]:
        """Validate, hold one of the client's stream slots, run on the backend, count it; the
        whole of it is the request's span (see the module docstring)."""
        call = call or Call(api)
        span = self.backend.tracer.start(call.name, call.traceparent, call.attributes, server=True, root=True)
        bind_request(spec.request_id, span.traceparent)
        done = started = False
        try:
            with self.limiter.hold(client):
                b = self.backend
                spec.tool_format = self.tool_format if spec.messages is not None else None
                inp = build_input(spec, b.tokenizer, b.model, self.limits, priority_classes=b.priority_classes,
                                  kv_capacity_tokens=b.kv_capacity_tokens, adapters=b.adapters)
                await _compiled(b, inp, spec)
                async with aclosing(self._run(_traced(inp, span), api)) as items:
                    async for item in items:
                        if not started:
                            started = True
                            bind_request(item.request_id, span.traceparent)
                            span.event("first_token")
                        done = item.end is not None
                        if item.end is not None and span.recording:
                            span.set(_end_attributes(item.request_id, item.end))
                        yield item
        except (asyncio.CancelledError, GeneratorExit) as e:  # client cancel, deadline, disconnect
            if not done:
                self.metrics.failed(api, "cancelled")
                span.fail(e)
            raise
        except BaseException as e:
            span.fail(e)
            raise
        finally:
            span.end()

    async def _run(self, inp: GenerationInput, api: str) -> AsyncIterator[TokenChunk]:
        """The backend's stream, counted: finished in metrics and the live window, rejected in
        the live window; either way recorded in the traffic log."""
        arrival = time.time()
        objective = resolve(self.backend.admission_config, inp.priority_class, inp.slo)
        try:
            async with aclosing(self.backend.generate(inp)) as items:
                async for item in items:
                    if item.end is not None:
                        self.metrics.finished(api, item.end, objective.slo_class.name, _trace_id(inp.span),
                                              meets(item.end, objective))
                        self.metrics.used(inp.params)
                        self.live.finished(item.end, objective)
                        self.traffic.record(arrival, inp.prompt_ids, item.end.usage.completion_tokens,
                                            inp.cache_salt, _adapter_name(inp))
                    yield item
        except RetryableRejection:
            self.traffic.record(arrival, inp.prompt_ids, inp.params.max_tokens, inp.cache_salt, _adapter_name(inp))
            raise

    def count_error(self, api: str, error: BaseException) -> None:
        """Every error a client receives is counted once, by the API that sends it."""
        status = status_of(error)
        self.metrics.failed(api, status.grpc.name)
        if isinstance(error, RetryableRejection) and not isinstance(error, TooManyStreamsError):
            self.live.rejected(error.reason)
        elif status.http >= 500:  # the server's failures; a client's own mistakes are not shown
            self.live.failed()


async def _compiled(backend: GenerationBackend, inp: GenerationInput, spec: RequestSpec) -> None:
    """The request's constraint compiled off the event loop (engine/grammar.py); one the grammar
    engine cannot enforce is refused here, naming the field the client gave it in."""
    if inp.params.constraint is None:  # nothing to compile: a backend's grammars are built on first use
        return
    try:
        await backend.grammars.prepare(inp.params)
    except InvalidRequestError as e:
        raise type(e)(spec.name(e.field), e.message) from None


def _traced(inp: GenerationInput, span: Span) -> GenerationInput:
    """The request with its span, which names what it asks for."""
    if not span.recording:
        return inp
    span.set({"gen_ai.usage.input_tokens": len(inp.prompt_ids), "gen_ai.request.max_tokens": inp.params.max_tokens,
              "halfmoon.priority_class": inp.priority_class or ""})
    return replace(inp, span=span)


def _end_attributes(request_id: str, end: RequestEnd) -> Attributes:
    t, u = end.timings, end.usage
    return {"halfmoon.request_id": request_id, "gen_ai.response.finish_reasons": [end.finish_reason.value],
            "gen_ai.usage.output_tokens": u.completion_tokens, "halfmoon.cached_prompt_tokens":
            u.cached_prompt_tokens, "halfmoon.ttft_ms": t.ttft_ms, "halfmoon.e2e_ms": t.e2e_ms,
            "halfmoon.queue_ms": t.queue_ms, "halfmoon.prefill_ms": t.prefill_ms,
            "halfmoon.transfer_ms": t.transfer_ms, "halfmoon.mean_tpot_ms": t.mean_tpot_ms}


def _trace_id(span: Span) -> str | None:
    """The request's trace id (the exemplar of its latency samples), when it is traced."""
    parent = span.traceparent
    return parent.split("-")[1] if parent else None


def _adapter_name(inp: GenerationInput) -> str:
    """The LoRA adapter a request ran under, as the traffic log names it ("" = the base model)."""
    return inp.params.adapter.name if inp.params.adapter is not None else ""
