"""Cluster-wide prefix hits: a prefix computed by one engine is fetched by another through the
Redis index (real redis-server) and the in-process remote reader; Redis down -> local only."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from engine.engine import Engine
from core.params import SamplingParams
from kvpool.redis_server import EmbeddedRedis
from kvpool.remote import InProcessReader

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture
def redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def pair(make_engine, redis: EmbeddedRedis) -> Iterator[tuple[Engine, Engine]]:
    reader = InProcessReader()
    engines = [make_engine(remote=reader, num_blocks=32, redis_url=redis.url, worker_id=f"w{i}",
                           node_id="node0") for i in range(2)]
    yield engines[0], engines[1]
    for engine in engines:
        engine.close()


def serve(engine: Engine, ids: list[int]) -> tuple[list[int], int]:
    before = engine.scheduler.stats.prompt_tokens_computed
    out = engine.generate([ids], PARAMS, cache_salt="cluster")[0].output_ids
    return out, engine.scheduler.stats.prompt_tokens_computed - before


def prompt(engine: Engine) -> list[int]:
    return engine.tokenizer.encode("Shared context for the whole cluster. " * 12)[:84]  # 5 blocks + 4


def test_prefix_computed_on_one_engine_is_a_hit_on_the_other(pair: tuple[Engine, Engine]) -> None:
    a, b = pair
    ids = prompt(a)
    out_a, computed_a = serve(a, ids)
    assert computed_a == len(ids)
    out_b, computed_b = serve(b, ids)
    assert computed_b == len(ids) - 5 * 16  # 5 blocks fetched from engine A
    assert b.tiers.traffic.fetched_remote == 5
    assert out_b == out_a
    b.pool.check_integrity()


def test_redis_down_means_local_only_serving_with_a_loud_log(pair: tuple[Engine, Engine],
                                                             redis: EmbeddedRedis,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    a, b = pair
    ids = prompt(a)
    out_a, _ = serve(a, ids)
    redis.stop()
    with caplog.at_level(logging.WARNING):
        out_b, computed_b = serve(b, ids)
    assert computed_b == len(ids)  # no index: B recomputes, and still answers
    assert out_b == out_a
    assert not b.tiers.index.healthy and b.tiers.index.stats.redis_errors > 0
    assert any("redis" in r.getMessage().lower() for r in caplog.records if r.levelno >= logging.WARNING)
