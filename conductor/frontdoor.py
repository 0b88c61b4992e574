"""What both APIs share: auth, the per-client stream limit, validation, the backend, metrics.

    door.client(authorization, peer)        -> client identity (or UnauthenticatedError)
    door.generate(spec, client, api)         -> async iterator of TokenChunk ..., the last with `end`
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from conductor.auth import Authenticator, StreamLimiter
from conductor.backend import GenerationBackend
from conductor.errors import status_of
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
                async with aclosing(self.backend.generate(inp)) as items:
                    async for item in items:
                        if item.end is not None:
                            done = True
                            self.metrics.finished(api, item.end)
                        yield item
        except (asyncio.CancelledError, GeneratorExit):  # client cancel, deadline, disconnect
            if not done:
                self.metrics.failed(api, "cancelled")
            raise

    def count_error(self, api: str, error: BaseException) -> None:
        """Every error a client receives is counted once, by the API that sends it."""
        self.metrics.failed(api, status_of(error).grpc.name)
