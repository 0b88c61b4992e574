"""The retry policy of both clients: UNAVAILABLE with exponential backoff and jitter; a rejection
(RESOURCE_EXHAUSTED with a retry hint) only when asked (`retry_rejected`), after the server's
hint; never after a stream delivered tokens, and one deadline across a call's attempts."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from halfmoon.core.errors import ConfigError
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
    """Retry UNAVAILABLE at most `max_retries` times, after `backoff_s * 2**n` seconds (n =
    retries so far, capped at `max_backoff_s`) with +-50% jitter. Retry a rejection (the server
    refused the request up front: `APIError.rejected`) at most `retry_rejected` times (default
    none), after the server's `retry_after_s` plus up to 20% (rejected clients do not all come
    back at the same instant)."""

    max_retries: int = 3
    backoff_s: float = 0.2
    max_backoff_s: float = MAX_BACKOFF_S
    retry_rejected: int = 0

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.retry_rejected < 0 or not self.backoff_s >= 0:
            raise ConfigError(f"max_retries, retry_rejected and backoff_s must be >= 0, got {self.max_retries}, "
                              f"{self.retry_rejected}, {self.backoff_s}")

    def should_retry(self, error: APIError, retries: int, received: int, rejected: int = 0) -> bool:
        """Whether a call that failed with `error`, having delivered `received` messages, may be
        sent again: `retries` retries after UNAVAILABLE and `rejected` after a rejection so far.
        Never after a stream delivered tokens."""
        if received:
            return False
        if error.code is grpc.StatusCode.UNAVAILABLE:
            return retries < self.max_retries
        return error.rejected and rejected < self.retry_rejected

    def delay_s(self, retries: int, rng: random.Random) -> float:
        base = min(self.max_backoff_s, self.backoff_s * 2**retries)
        return base * (0.5 + rng.random())

    @staticmethod
    def rejected_delay_s(error: APIError, rng: random.Random) -> float:
        """The pause after a rejection: the server's hint, never less."""
        return (error.retry_after_s or 0.0) * (1.0 + 0.2 * rng.random())


class Attempts:
    """The attempts of one call: its deadline across retries, and the pause before each retry."""

    __slots__ = ("deadline", "on_retry", "policy", "rejected", "retries", "rng")

    def __init__(self, policy: RetryPolicy, timeout: float | None, on_retry: RetryHook | None,
                 rng: random.Random) -> None:
        self.policy = policy
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.on_retry = on_retry
        self.rng = rng
        self.retries = 0  # after UNAVAILABLE
        self.rejected = 0  # after a rejection

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
        if not self.policy.should_retry(error, self.retries, received, self.rejected):
            raise error
        if error.rejected:
            delay = self.policy.rejected_delay_s(error, self.rng)
        else:
            delay = self.policy.delay_s(self.retries, self.rng)
            if error.retry_after_s is not None:
                delay = max(delay, error.retry_after_s)
        if self.deadline is not None and time.monotonic() + delay >= self.deadline:
            raise error  # the retry could not finish in time: report why the last attempt failed
        if error.rejected:
            self.rejected += 1
        else:
            self.retries += 1
        log.info("retry %d in %.2f s after %s", self.retries + self.rejected, delay, error)
        if self.on_retry is not None:
            self.on_retry(RetryEvent(self.retries + self.rejected, delay, error))
        return delay

    def failed(self, error: grpc.RpcError, received: int = 0) -> float:
        """`backoff` for a failed gRPC call (sync or aio), its status decoded into an APIError."""
        return self.backoff(error_from_rpc(error), received)
