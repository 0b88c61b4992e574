"""The disaggregated cluster end to end: real Ray actors (prefill and decode workers in their own
processes), real KV transport over TCP sockets, a real Redis index, behind the real front door.

One 2P2D cluster serves the module; a 1P1D cluster is started for its own test. The Conductor
(the front door + `ClusterBackend`) runs in this process, like `halfmoon serve` runs it.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from halfmoon.bench.sim_vs_live import worker_kv_blocks
from halfmoon.conductor.ledger import PendingPrefill
from halfmoon.core.params import Constraint, ConstraintKind, SamplingParams
from halfmoon.engine.engine import Engine
from halfmoon.v1 import generation_pb2 as pb
from halfmoon.v1 import generation_pb2_grpc as pb_grpc
from halfmoon.kvpool.redis_server import EmbeddedRedis
from tests.conductor.conftest import RunningApi
from tests.engine.constraint_cases import SCHEMAS
from tests.e2e.support import (
    generate_all,
    prompts,
    reference,
    start_cluster,
    worker_load,
)
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis: EmbeddedRedis) -> Iterator[RunningApi]:
    api = start_cluster(tmp_path_factory.mktemp("cluster"), 2, 2, redis)
    yield api
    api.stop()


def test_2p2d_is_token_identical_to_one_process(cluster: RunningApi, engine: Engine) -> None:
    ids = prompts(engine)
    max_tokens = [4 + (i * 5) % 13 for i in range(16)]
    got = generate_all(cluster.grpc_target, ids, max_tokens)
    assert got == reference(engine, ids, max_tokens)
    for wid in ("decode-0", "decode-1"):  # every reserved block came back or became prefix cache
        wait_until(lambda wid=wid: worker_load(cluster, wid).requests == 0, what=f"{wid} idle")
    used = {wid: worker_load(cluster, wid) for wid in ("prefill-0", "prefill-1", "decode-0", "decode-1")}
    assert sum(u.prompt_tokens_computed for wid, u in used.items() if wid.startswith("prefill")) > 0
    assert all(u.alive for u in used.values())
    stats = cluster.backend.stats()  # what /metrics shows: nothing in flight, the decode pools' blocks
    assert (stats.requests_running, stats.requests_waiting) == (0, 0)
    assert stats.kv_blocks_total == 2 * 256
    # one worker's pool, what a simulated worker holds (`bench serve --planner-compare`), not the sum
    assert worker_kv_blocks(cluster.http_url) == 256


def test_a_prefix_computed_on_a_busy_worker_is_reused_by_the_other(cluster: RunningApi, engine: Engine) -> None:
    """Prefill worker A computes a prefix; A is then busy with a long prompt, so the router sends
    the next request with that prefix to B, which pulls A's blocks (found in the index) instead
    of computing them: B prefills only the suffix, and the output is unchanged."""
    tok = engine.tokenizer
    prefix = tok.encode("You are a helpful assistant who answers in one sentence. " * 8)[:64]  # 4 full blocks
    assert len(prefix) == 64
    first = prefix + tok.encode(" Question: what is the capital of France?")
    second = prefix + tok.encode(" Question: name a large ocean.")
    busy = tok.encode("Tell me a long story about the moon. " * 90)[:1500]
    before = {w: worker_load(cluster, w) for w in ("prefill-0", "prefill-1")}
    generate_all(cluster.grpc_target, [first], [2])  # lands on one worker: A
    after_first = {w: worker_load(cluster, w) for w in ("prefill-0", "prefill-1")}
    a = max(after_first, key=lambda w: after_first[w].prompt_tokens_computed - before[w].prompt_tokens_computed)
    b = ({"prefill-0", "prefill-1"} - {a}).pop()
    hold = PendingPrefill("hold", 0, math.inf, 1e6, time.monotonic())  # a fake 1000 s job ...
    cluster.backend.manager.workers[b].pending.add(hold)  # ... keeps the long prompt off B
    results: list = []
    long_request = threading.Thread(target=lambda: results.append(generate_all(cluster.grpc_target, [busy], [1])))
    long_request.start()
    wait_until(lambda: cluster.backend.manager.workers[a].pending.depth > 0, what="the long prompt queued on A")
    cluster.backend.manager.workers[b].pending.finish("hold", time.monotonic())  # ... then B is idle again
    got = generate_all(cluster.grpc_target, [second], [8])
    long_request.join(300)
    end = {w: worker_load(cluster, w) for w in ("prefill-0", "prefill-1")}
    assert end[b].blocks_fetched_remote - after_first[b].blocks_fetched_remote >= len(prefix) // 16
    computed_on_b = end[b].prompt_tokens_computed - after_first[b].prompt_tokens_computed
    assert computed_on_b <= len(second) - len(prefix)  # only the suffix
    assert got == reference(engine, [second], [8])
    assert results and len(results[0][0]) == 1


def _stream(target: str, prompt_ids: list[int], max_tokens: int, json_schema: str = ""):
    channel = grpc.insecure_channel(target)
    req = pb.GenerateRequest(prompt_token_ids=prompt_ids, max_tokens=max_tokens, ignore_eos=True,
                             constraint=pb.Constraint(json_schema=json_schema) if json_schema else None)
    return channel, pb_grpc.GenerationStub(channel).Generate(req, timeout=120)


def _busiest(api: RunningApi, role: str) -> str:
    """The worker of `role` with the most requests the Conductor has on it."""
    workers = api.backend.manager.role(role)
    return max(workers, key=lambda w: w.pending.depth if role == "prefill" else len(w.bound.jobs)).spec.worker_id


def _kill(api: RunningApi, worker_id: str) -> None:
    import ray

    ray.kill(api.backend.manager.workers[worker_id].api.handle, no_restart=False)  # Ray restarts it


def _all_alive_again(api: RunningApi) -> bool:
    return all(w.alive for w in api.backend.manager.workers.values())



def test_a_kv_transfer_that_fails_before_the_first_token_is_re_run(cluster: RunningApi, engine: Engine,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A KV unit corrupted on the wire (the prefill workers' drill hook): the decode side
    refuses the data and gives its blocks back, and the Conductor re-runs the request: the
    client only sees the right tokens."""
    import ray

    ids = engine.tokenizer.encode("The first law of thermodynamics states that")
    rid = "drill-corrupt-push"
    reruns = cluster.backend.stats().requests_rerun.get("kv_transfer", 0)
    for worker in cluster.backend.manager.role("prefill"):  # whichever gets it: only this id's first try
        ray.get(worker.api.handle.corrupt_next_push.remote(rid))
    with caplog.at_level(logging.WARNING, logger="halfmoon.conductor.cluster"), grpc.insecure_channel(cluster.grpc_target) as ch:
        req = pb.GenerateRequest(prompt_token_ids=ids, max_tokens=4, ignore_eos=True, request_id=rid)
        tokens = [t for r in pb_grpc.GenerationStub(ch).Generate(req, timeout=120) for t in r.token_ids]
    assert tokens == reference(engine, [ids], [4])[0]
    assert f"request {rid}" in caplog.text and "checksum mismatch" in caplog.text and "re-running it" in caplog.text
    assert cluster.backend.stats().requests_rerun["kv_transfer"] == reruns + 1  # halfmoon_requests_rerun
    for wid in ("decode-0", "decode-1"):
        wait_until(lambda wid=wid: worker_load(cluster, wid).reserved == 0, what=f"{wid} released")

def test_killing_the_decode_worker_mid_stream_moves_the_request(cluster: RunningApi, engine: Engine) -> None:
    """The stream goes on on the other decode worker (conductor/migration.py): the client sees a
    pause, and the text it would have got. The request is held to a JSON schema: its first token
    was masked on the prefill worker, the rest on two decode workers, each matcher caught up from
    the token history alone, and the whole is the co-located constrained output."""
    ids = engine.tokenizer.encode("Count slowly from one to one hundred, as a JSON list of objects:")
    migrated = cluster.backend.stats().requests_rerun.get("migrated", 0)
    schema = json.dumps({"type": "array", "minItems": 20, "items": SCHEMAS["person"]})
    channel, call = _stream(cluster.grpc_target, ids, 60, schema)
    with channel:
        responses = iter(call)
        tokens = [t for _, r in zip(range(3), responses) for t in r.token_ids]
        victim = _busiest(cluster, "decode")
        restarts = cluster.backend.manager.workers[victim].restarts
        t0 = time.monotonic()
        _kill(cluster, victim)
        tokens += [t for r in responses for t in r.token_ids]
    constrained = SamplingParams(max_tokens=60, ignore_eos=True,
                                 constraint=Constraint(ConstraintKind.JSON_SCHEMA, schema))
    assert tokens == engine.generate([ids], constrained)[0].output_ids
    assert time.monotonic() - t0 < 30
    assert cluster.backend.stats().requests_rerun["migrated"] == migrated + 1
    wait_until(lambda: cluster.backend.manager.workers[victim].restarts > restarts and _all_alive_again(cluster),
               timeout_s=120, what=f"{victim} restarted and healthy")
    for wid in ("decode-0", "decode-1"):  # the first try's reservation was given back (or died with it)
        wait_until(lambda wid=wid: worker_load(cluster, wid).reserved == 0, what=f"{wid} released")
    later = [ids, engine.tokenizer.encode("The capital of France is")]
    assert generate_all(cluster.grpc_target, later, [5, 5]) == reference(engine, later, [5, 5])


def test_killing_a_prefill_worker_mid_transfer_frees_the_reservation(cluster: RunningApi,
                                                                     engine: Engine) -> None:
    """No token was sent yet: the request is re-run on the other prefill worker, transparently;
    the decode side gave the first reservation back."""
    long_prompt = engine.tokenizer.encode("Summarize the history of astronomy. " * 80)[:1200]
    prefills = ("prefill-0", "prefill-1")
    computed = {wid: worker_load(cluster, wid).prompt_tokens_computed for wid in prefills}

    def chunks_done() -> int:  # prompt tokens prefilled since the request was sent
        return sum(worker_load(cluster, wid).prompt_tokens_computed - computed[wid] for wid in prefills)

    channel, call = _stream(cluster.grpc_target, long_prompt, 4)
    with channel:
        responses = iter(call)
        wait_until(lambda: any(w.pending.depth > 0 for w in cluster.backend.manager.role("prefill")),
                   what="the prefill dispatched")
        # Inside the chunked prefill: a chunk computed (its layers pushed), the rest not yet.
        wait_until(chunks_done, what="the first prefill chunk computed")
        victim = _busiest(cluster, "prefill")
        restarts = cluster.backend.manager.workers[victim].restarts
        reruns = sum(cluster.backend.stats().requests_rerun.values())
        _kill(cluster, victim)
        tokens = [t for r in responses for t in r.token_ids]
    assert tokens == reference(engine, [long_prompt], [4])[0]
    # Re-run once: as a lost worker, or as a failed transfer if the decode side saw it first.
    assert sum(cluster.backend.stats().requests_rerun.values()) == reruns + 1
    for wid in ("decode-0", "decode-1"):  # every reservation was given back or became prefix cache
        wait_until(lambda wid=wid: worker_load(cluster, wid).reserved == 0, what=f"{wid} released")
        load = worker_load(cluster, wid)
        assert load.free_blocks == load.total_blocks and load.requests == 0
    wait_until(lambda: cluster.backend.manager.workers[victim].restarts > restarts and _all_alive_again(cluster),
               timeout_s=120, what=f"{victim} restarted and healthy")
    assert generate_all(cluster.grpc_target, [long_prompt[:40]], [3]) == reference(engine, [long_prompt[:40]], [3])


def test_serving_continues_through_a_redis_restart(cluster: RunningApi, redis: EmbeddedRedis,
                                                   engine: Engine) -> None:
    ids = [engine.tokenizer.encode("Name three colors."), engine.tokenizer.encode("What is two plus two?")]
    want = reference(engine, ids, [4, 4])
    redis.stop()
    try:
        assert generate_all(cluster.grpc_target, ids, [4, 4]) == want  # the index is down: local only
    finally:
        redis.start()
    assert generate_all(cluster.grpc_target, ids, [4, 4]) == want


def test_a_hung_redis_does_not_stall_the_front_door(cluster: RunningApi, redis: EmbeddedRedis,
                                                    engine: Engine) -> None:
    """Redis stops answering (CLIENT PAUSE, past the index's 2 s socket timeout) while a request
    is in its index lookup: the lookup waits off the event loop, so the front door answers
    another call at once; the request then goes on without the index (local tiers only)."""
    import redis as redis_py

    # Two full blocks or more, so the lookup has hashes to ask Redis about.
    ids = [engine.tokenizer.encode("List five fruits and, for each one, the colour of its skin "
                                   "when ripe, its usual size, where it grows best, which month "
                                   "it is picked in, and one dish it is often cooked in.")]
    assert len(ids[0]) >= 2 * 16
    want = reference(engine, ids, [3])
    index = cluster.backend.index
    assert index is not None

    def answered_with_the_index_healthy() -> bool:  # after a Redis restart it may be backing off
        assert generate_all(cluster.grpc_target, ids, [3]) == want
        return index.healthy

    wait_until(answered_with_the_index_healthy, timeout_s=60, what="the Conductor's index on Redis")
    errors = index.stats.redis_errors
    out: list[list[list[int]]] = []
    lookups = index.stats.lookups
    redis_py.Redis.from_url(redis.url).client_pause(3500, all=True)
    request = threading.Thread(target=lambda: out.append(generate_all(cluster.grpc_target, ids, [3])))
    request.start()
    # The lookup is counted just before its Redis call, which then hangs for the socket timeout.
    wait_until(lambda: index.stats.lookups > lookups, timeout_s=10, what="the request's index lookup")
    with grpc.insecure_channel(cluster.grpc_target) as channel:
        start = time.perf_counter()
        pb_grpc.GenerationStub(channel).ListModels(pb.ListModelsRequest(), timeout=10)
        took = time.perf_counter() - start
    request.join(120)
    assert took < 1.0, f"the front door took {took:.2f} s to answer while Redis hung"
    assert out == [want]
    assert index.stats.redis_errors > errors, index.stats  # the lookup did wait for Redis
