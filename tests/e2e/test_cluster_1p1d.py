"""The disaggregated cluster at its smallest, 1 prefill + 1 decode worker: token-identical to one
process for 16 concurrent requests of mixed lengths, over ucxx (what `auto`, the default, picks
where it imports). The 2P2D cluster of test_cluster.py runs the same check over tcp, and
tests/transport the tcp fallback between processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from halfmoon.engine.engine import Engine
from halfmoon.kvpool.redis_server import EmbeddedRedis
from tests.e2e.support import generate_all, prompts, reference, start_cluster, worker_load

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_1p1d_is_token_identical_to_one_process(tmp_path: Path, redis: EmbeddedRedis, engine: Engine) -> None:
    small = start_cluster(tmp_path, 1, 1, redis, "ucxx")
    try:
        ids = prompts(engine)
        max_tokens = [3 + (i * 7) % 11 for i in range(16)]
        assert generate_all(small.grpc_target, ids, max_tokens) == reference(engine, ids, max_tokens)
        assert worker_load(small, "decode-0").kv_address.startswith("ucxx://")
    finally:
        small.stop()
