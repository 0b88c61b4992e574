"""End-to-end fixtures: one embedded Redis per module (the cluster's block index)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from halfmoon.kvpool.redis_server import EmbeddedRedis


@pytest.fixture(scope="module")
def redis() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis()
    server.start()
    yield server
    server.stop()
