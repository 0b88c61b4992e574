"""The disaggregated cluster at its smallest, 1 prefill + 1 decode worker: token-identical to one
process for 16 concurrent requests of mixed lengths (see test_cluster.py for the 2P2D cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.engine import Engine
from kvpool.redis_server import EmbeddedRedis
from tests.e2e.support import generate_all, prompts, reference, start_cluster, worker_load

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize("kv_transport", ["tcp", "ucxx"])
def test_1p1d_is_token_identical_to_one_process(tmp_path: Path, redis: EmbeddedRedis, engine: Engine,
                                                kv_transport: str) -> None:
    """Over both KV transports: ucxx is what `auto` (the default) picks where it imports."""
    small = start_cluster(tmp_path, 1, 1, redis, kv_transport)
    try:
        ids = prompts(engine)
        max_tokens = [3 + (i * 7) % 11 for i in range(16)]
        assert generate_all(small.grpc_target, ids, max_tokens) == reference(engine, ids, max_tokens)
        assert worker_load(small, "decode-0").kv_address.startswith(f"{kv_transport}://")
    finally:
        small.stop()
