"""Bearer-token auth and the per-client stream limit, shared by the gRPC and HTTP front doors.

Tokens come from a file (one per line, `#` comments; e.g. a mounted Kubernetes Secret) or from
`HALFMOON_API_TOKENS` (comma-separated) — never from a command line. No tokens = auth off.

Admin tokens (the admin API: loading and unloading LoRA adapters) are a second, separate set:
`--admin-token-file` or `HALFMOON_ADMIN_TOKENS`. No admin tokens = the admin API is closed (403),
never open: changing what a server serves is not a default.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from halfmoon.conductor.errors import PermissionDeniedError, TooManyStreamsError, UnauthenticatedError
from halfmoon.core.errors import ConfigError

TOKENS_ENV = "HALFMOON_API_TOKENS"
ADMIN_TOKENS_ENV = "HALFMOON_ADMIN_TOKENS"
ADMIN_OFF = ("the admin API is off: start the server with --admin-token-file FILE (admin bearer tokens, one "
             f"a line) or {ADMIN_TOKENS_ENV}=TOKEN[,TOKEN...], then send 'authorization: Bearer <admin token>'")


def load_tokens(token_file: str | None, env: str = TOKENS_ENV, what: str = "API") -> list[str]:
    """Tokens from `token_file` if given, else from the variable `env` (HALFMOON_API_TOKENS);
    [] = none. `what` names the tokens in errors (API, admin)."""
    if token_file is not None:
        try:
            lines = Path(token_file).read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"cannot read the {what} token file {token_file}: {e}") from e
        tokens = [t.strip() for t in lines if t.strip() and not t.strip().startswith("#")]
        if not tokens:
            raise ConfigError(f"the {what} token file {token_file} holds no token")
        return tokens
    return [t.strip() for t in os.environ.get(env, "").split(",") if t.strip()]


def load_admin_tokens(token_file: str | None) -> list[str]:
    """Admin tokens from `token_file` if given, else from HALFMOON_ADMIN_TOKENS; [] = admin API off."""
    return load_tokens(token_file, ADMIN_TOKENS_ENV, "admin")


class Authenticator:
    """Checks `authorization: Bearer <token>`; identifies the client for per-client limits."""

    def __init__(self, tokens: list[str]) -> None:
        self._tokens = [t.encode() for t in tokens]

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def check(self, authorization: str | None) -> str | None:
        """The client's identity (a digest of its token) or None when auth is off.
        Raises UnauthenticatedError on a missing or wrong token."""
        if not self._tokens:
            return None
        if not authorization:
            raise UnauthenticatedError("missing bearer token: send 'authorization: Bearer <token>'")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise UnauthenticatedError("the authorization header must be 'Bearer <token>'")
        given = token.strip().encode()
        # Compare against every token (no early exit) so timing does not tell which matched.
        matched = [hmac.compare_digest(given, t) for t in self._tokens]
        if not any(matched):
            raise UnauthenticatedError("invalid bearer token")
        return "token:" + hashlib.sha256(given).hexdigest()[:16]

    def check_admin(self, authorization: str | None) -> None:
        """As `check`, for the admin API: with no tokens it is closed (PermissionDeniedError
        saying how to open it), not open."""
        if not self._tokens:
            raise PermissionDeniedError(ADMIN_OFF)
        self.check(authorization)


class StreamLimiter:
    """At most `limit` requests in flight per client (thread-safe)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._active: dict[str, int] = {}
        self._lock = threading.Lock()

    @contextmanager
    def hold(self, client: str) -> Iterator[None]:
        with self._lock:
            n = self._active.get(client, 0)
            if n >= self.limit:
                raise TooManyStreamsError(f"this client already has {n} requests in flight "
                                          f"(limit {self.limit})", retry_after_s=1.0, reason="too_many_streams")
            self._active[client] = n + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._active.pop(client) - 1
                if left:
                    self._active[client] = left

    def active(self) -> int:
        with self._lock:
            return sum(self._active.values())
