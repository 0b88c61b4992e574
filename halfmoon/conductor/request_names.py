"""A request's two names: the client's id, and the name each try of it has inside the engines.

A client id is taken while its request runs on this backend (a second request naming it is a 400)
and free again the moment its stream closes, ended or cancelled. Inside an engine or a worker the
request goes by `{id}@{n}`, `n` counting this backend's tries: an engine frees a cancelled request
at its next step, so a client that cancels and retries at once under the same id (what retry loops
and fuzzers do) must not meet the old try there, nor its last output routed to the new stream.
"""

from __future__ import annotations

import itertools
import uuid

from halfmoon.core.errors import InvalidRequestError


class RequestNames:
    """The client ids running on one backend, and each try's engine-side name (event-loop only)."""

    def __init__(self) -> None:
        self._running: set[str] = set()
        self._tries = itertools.count(1)

    def claim(self, request_id: str | None) -> str:
        """The request's client id (a fresh one when it named none), taken until `release`."""
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        if rid in self._running:
            raise InvalidRequestError("request_id", f"{rid!r} is already in use by a running request")
        self._running.add(rid)
        return rid

    def release(self, rid: str) -> None:
        self._running.discard(rid)

    def inner(self, rid: str) -> str:
        """A fresh engine-side name for one try of `rid` (never used before on this backend)."""
        return f"{rid}@{next(self._tries)}"

    def __len__(self) -> int:
        return len(self._running)
