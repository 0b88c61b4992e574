"""Cluster-wide prefix hits: a prefix computed by one engine is fetched by another through the
Redis index (real redis-server) and the in-process remote reader; Redis down -> local only."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from halfmoon.engine.engine import Engine
from halfmoon.core.params import SamplingParams
from halfmoon.kvpool.redis_server import EmbeddedRedis
from halfmoon.kvpool.cluster_index import HolderId
from halfmoon.kvpool.remote import InProcessReader, RemoteBlockReader

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
    assert engine.tiers.flush(30)  # its index announcements are written behind
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


class GatedReader(RemoteBlockReader):
    """The in-process reader of the holders behind a gate: a pull waits until the test opens it,
    as a pull from a slow or hung holder would."""

    def __init__(self, inner: InProcessReader) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.pulls = 0

    def fetch(self, holder: HolderId, hashes: Sequence[bytes], dst) -> int:
        self.pulls += 1
        assert self.gate.wait(60), "the test never opened the gate"
        return self.inner.fetch(holder, hashes, dst)


@pytest.fixture
def gated(make_engine, redis: EmbeddedRedis) -> Iterator[tuple[Engine, Engine, GatedReader]]:
    reader = InProcessReader()
    gate = GatedReader(reader)
    a = make_engine(remote=reader, num_blocks=32, redis_url=redis.url, worker_id="holder", node_id="node-a")
    b = make_engine(remote=gate, num_blocks=32, redis_url=redis.url, worker_id="puller", node_id="node-b")
    yield a, b, gate
    gate.gate.set()
    for engine in (a, b):
        engine.close()


def steps_until(engine: Engine, done, timeout_s: float = 60.0) -> list:
    """Step `engine` (at least once: new requests enter at a step) until `done()`; its chunks.
    A step with every request fetching returns at once: the bound is time, not steps."""
    chunks = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        chunks += engine.step()
        if done():
            return chunks
    raise AssertionError(f"not done within {timeout_s:g} s")


def test_a_request_waiting_for_its_prefix_does_not_stop_the_others(gated) -> None:
    """While B pulls a prefix from A (a hung holder, here), B's other requests keep running; the
    pulled blocks are used once they arrive (the request computes only its suffix)."""
    a, b, gate = gated
    ids = prompt(a)
    out_a, _ = serve(a, ids)
    other = a.tokenizer.encode("An unrelated question about the sea.")
    waiting = b.add_request(ids, PARAMS, cache_salt="cluster")
    running = b.add_request(other, PARAMS, cache_salt="cluster")
    chunks = steps_until(b, lambda: running not in b.scheduler.requests)
    assert gate.pulls == 1 and waiting in b.scheduler.fetching  # still waiting for A's blocks ...
    assert sum(len(c.token_ids) for c in chunks if c.request_id == running) == PARAMS.max_tokens  # ... B ran on
    assert b.only_fetching()
    before = b.scheduler.stats.prompt_tokens_computed
    gate.gate.set()
    chunks = steps_until(b, lambda: waiting not in b.scheduler.requests)
    assert [t for c in chunks if c.request_id == waiting for t in c.token_ids] == out_a
    assert b.scheduler.stats.prompt_tokens_computed - before == len(ids) - 5 * 16
    assert b.tiers.traffic.fetched_remote == 5
    b.pool.check_integrity()


def test_a_request_aborted_while_fetching_leaves_nothing_behind(gated) -> None:
    a, b, gate = gated
    ids = prompt(a)
    serve(a, ids)
    rid = b.add_request(ids, PARAMS, cache_salt="cluster")
    steps_until(b, lambda: rid in b.scheduler.fetching)
    b.abort(rid)
    steps_until(b, lambda: not b.has_unfinished())
    gate.gate.set()  # the pull ends after its request: its rows are dropped
    assert b.scheduler.requests == {} and b.pool.num_free() == b.pool.num_blocks
    b.pool.check_integrity()
