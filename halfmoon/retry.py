"""The retry policy of both clients: UNAVAILABLE only, exponential backoff with jitter, never
after a stream delivered tokens, and one deadline across a call's attempts."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from core.errors import ConfigError
from halfmoon.errors import APIError, DeadlineExceededError, error_from_rpc

log = logging.getLogger("halfmoon.client")

MAX_BACKOFF_S = 10.0


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


class Attempts:
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

    def failed(self, error: grpc.RpcError, received: int = 0) -> float:
        """`backoff` for a failed gRPC call (sync or aio), its status decoded into an APIError."""
        return self.backoff(error_from_rpc(error), received)
