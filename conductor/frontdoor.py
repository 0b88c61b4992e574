"""What both APIs share: auth, the per-client stream limit, validation, the backend, metrics.

    door.client(authorization, peer)        -> client identity (or UnauthenticatedError)
    door.generate(spec, client, api)         -> async iterator of TokenChunk ..., the last with `end`

Every request that reaches the backend is also counted in `door.live` (the dashboard's recent
history, conductor/live.py) and recorded in `door.traffic` (the Mooncake-format log the sizing
page replays), finished or rejected.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from conductor.auth import Authenticator, StreamLimiter
from conductor.backend import GenerationBackend
from conductor.admission import resolve
from conductor.backend import GenerationInput
from conductor.errors import RetryableRejection, TooManyStreamsError, status_of
from conductor.live import LiveWindow, TrafficRecorder
from conductor.metrics import Metrics
from conductor.requests import Limits, RequestSpec, build_input
from core.messages import TokenChunk


class FrontDoor:
    def __init__(self, backend: GenerationBackend, limits: Limits, auth: Authenticator) -> None:
        self.backend = backend
        self.limits = limits
        self.auth = auth
        self.limiter = StreamLimiter(limits.max_streams_per_client)
        self.metrics = Metrics(backend.stats)
        self.live = LiveWindow()
        self.traffic = TrafficRecorder()

    def client(self, authorization: str | None, peer: str) -> str:
        """Who is calling: their token's digest when auth is on, else their address."""
        return self.auth.check(authorization) or "peer:" + peer

    async def generate(self, spec: RequestSpec, client: str, api: str) -> AsyncIterator[TokenChunk]:
        """Validate, hold one of the client's stream slots, run on the backend, count it."""
        done = False
        try:
            with self.limiter.hold(client):
                b = self.backend
                inp = build_input(spec, b.tokenizer, b.model, self.limits, priority_classes=b.priority_classes,
                                  kv_capacity_tokens=b.kv_capacity_tokens)
                async with aclosing(self._run(inp, api)) as items:
                    async for item in items:
                        done = item.end is not None
                        yield item
        except (asyncio.CancelledError, GeneratorExit):  # client cancel, deadline, disconnect
            if not done:
                self.metrics.failed(api, "cancelled")
            raise

    async def _run(self, inp: GenerationInput, api: str) -> AsyncIterator[TokenChunk]:
        """The backend's stream, counted: finished in metrics and the live window, rejected in
        the live window; either way recorded in the traffic log."""
        arrival = time.time()
        objective = resolve(self.backend.admission_config, inp.priority_class, inp.slo)
        try:
            async with aclosing(self.backend.generate(inp)) as items:
                async for item in items:
                    if item.end is not None:
                        self.metrics.finished(api, item.end)
                        self.live.finished(item.end, objective)
                        self.traffic.record(arrival, inp.prompt_ids, item.end.usage.completion_tokens,
                                            inp.cache_salt)
                    yield item
        except RetryableRejection:
            self.traffic.record(arrival, inp.prompt_ids, inp.params.max_tokens, inp.cache_salt)
            raise

    def count_error(self, api: str, error: BaseException) -> None:
        """Every error a client receives is counted once, by the API that sends it."""
        status = status_of(error)
        self.metrics.failed(api, status.grpc.name)
        if isinstance(error, RetryableRejection) and not isinstance(error, TooManyStreamsError):
            self.live.rejected(error.reason)
        elif status.http >= 500:  # the server's failures; a client's own mistakes are not shown
            self.live.failed()
