"""Cluster-wide prefix hits across Ray nodes (issue 24): a Ray head and a second raylet on this
machine (`ray start --head`, then `ray start --address ...`: two Ray nodes, two node ids), the
Conductor joining them as `halfmoon serve --ray-address` does, prefill-0 and prefill-1 placed by
their `prefill` resource on different nodes, real KV transport over TCP, a real Redis index.

    node A (head): {"prefill": 1, "decode": 1}       node B: {"prefill": 1}
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from halfmoon.bench.ray_nodes import LocalRayNodes, is_alive
from halfmoon.conductor.cluster import ClusterBackend
from halfmoon.conductor.cluster_config import ClusterConfig
from halfmoon.conductor.ledger import PendingPrefill
from halfmoon.conductor.router import RouteRequest, PrefillView
from halfmoon.api.server import ServerConfig
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.kvpool.block_hash import block_hashes, root_hash
from halfmoon.kvpool.redis_server import EmbeddedRedis
from halfmoon.kvpool.tiers import Tier
from tests.conductor.conftest import CLIENT_SLOS_ONLY, RunningApi, run_api
from tests.e2e.support import cost_model_file, generate_all, reference, worker_load
from tests.waiting import wait_until
from halfmoon.transport.config import TransportConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NODE_A = {"prefill": 1, "decode": 1}
NODE_B = {"prefill": 1}
PREFILL = ("prefill-0", "prefill-1")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayNodes]:
    # A short path: Ray's unix sockets live under it (108 characters at most).
    temp = Path(tmp_path_factory.mktemp("ray", numbered=True))
    with LocalRayNodes([NODE_A, NODE_B], temp, num_cpus=2) as started:
        yield started
    # a killed process can take a moment to be reaped after `stop` returns (seen once: one pid
    # gone a few seconds later); one still alive after 15 s is a leak
    wait_until(lambda: not started.leftovers(), 15.0, "the Ray nodes' processes to exit after their stop")


@pytest.fixture(scope="module")
def cluster(nodes: LocalRayNodes, tmp_path_factory: pytest.TempPathFactory,
            redis: EmbeddedRedis) -> Iterator[RunningApi]:
    import ray

    config = ClusterConfig(prefill=2, decode=1, ray_address=nodes.address,
                           engine=EngineConfig(num_blocks=256, max_num_batched_tokens=256),
                           transport=TransportConfig(backend="tcp", timeout_s=20.0), worker_threads=1,
                           cost_model=cost_model_file(tmp_path_factory.mktemp("cost") / "cost.json"),
                           request_timeout_s=60.0)
    api = run_api(ClusterBackend(config, redis.url, admission=CLIENT_SLOS_ONLY), ServerConfig(grpc_port=0, http_port=0))
    yield api
    api.stop()  # kills the actors; the joined Ray is not ours to shut down ...
    ray.shutdown()  # ... but this process's connection to it is


def test_prefill_workers_sit_on_different_ray_nodes(cluster: RunningApi) -> None:
    import ray

    loads = {w: worker_load(cluster, w) for w in (*PREFILL, "decode-0")}
    ray_nodes = {n["NodeID"][:12] for n in ray.nodes() if n["Alive"]}
    assert len(ray_nodes) == 2
    assert loads["prefill-0"].node_id != loads["prefill-1"].node_id
    assert {loads[w].node_id for w in PREFILL} == ray_nodes
    head = next(n["NodeID"][:12] for n in ray.nodes() if n["Alive"] and "decode" in n["Resources"])
    assert loads["decode-0"].node_id == head  # only node A advertises `decode`
    assert {w.node_id for w in cluster.backend.manager.workers.values()} == ray_nodes


def test_a_prefix_prefilled_on_node_a_is_fetched_by_a_worker_on_node_b(cluster: RunningApi,
                                                                         engine: Engine) -> None:
    """Issue 24, point 1: prefill on A; the same prefix routed to B is served with the prefix
    fetched from A (B's fetched and A's served counters), output identical to a cold run."""
    tok = engine.tokenizer
    prefix = tok.encode("Shared system prompt for every node of the cluster. " * 12)[:96]  # 6 blocks
    assert len(prefix) == 96
    first = prefix + tok.encode(" Question: what is the capital of France?")
    second = prefix + tok.encode(" Question: name a large ocean.")
    before = {w: worker_load(cluster, w) for w in PREFILL}
    generate_all(cluster.grpc_target, [first], [2])
    after = {w: worker_load(cluster, w) for w in PREFILL}
    a = max(PREFILL, key=lambda w: after[w].prompt_tokens_computed - before[w].prompt_tokens_computed)
    b = next(w for w in PREFILL if w != a)
    assert after[a].node_id != after[b].node_id

    # The index names A's worker, node and tier for the prefix; the router prices B's pull.
    hashes = _hashes(cluster, engine, second)[: len(prefix) // 16]
    match = cluster.backend.index.lookup(hashes).match(_holder(cluster, a))
    assert match is not None and match.length == len(hashes) and match.tier is Tier.DEVICE
    assert (match.holder.worker_id, match.holder.node_id) == (a, after[a].node_id)
    seen = cluster.backend.prefix_match(second, None)
    assert (seen.best_holder, seen.best_tokens, seen.per_worker.get(b, 0)) == (a, len(prefix), 0)
    router = cluster.backend.dispatcher.router
    pull = router.estimate_prefill(RouteRequest(len(second), 8, seen.best_tokens, a), PrefillView(b, 0, 0.0))
    assert (pull.fetch_tokens, pull.prefix_len) == (len(prefix), len(prefix)) and pull.transfer_ms > 0

    with _held(cluster, a):  # A looks busy: the router sends the request to B
        got = generate_all(cluster.grpc_target, [second], [8])
    end = {w: worker_load(cluster, w) for w in PREFILL}
    fetched = end[b].blocks_fetched_remote - after[b].blocks_fetched_remote
    assert fetched == len(prefix) // 16
    assert end[a].blocks_served_remote - after[a].blocks_served_remote == fetched
    assert end[b].prompt_tokens_computed - after[b].prompt_tokens_computed == len(second) - len(prefix)
    assert got == reference(engine, [second], [8])  # a cold run's tokens
    wait_until(lambda: worker_load(cluster, "decode-0").requests == 0, what="decode-0 idle")


def _hashes(cluster: RunningApi, engine: Engine, ids: list[int]) -> list[bytes]:
    info = cluster.backend.info
    assert info is not None
    return block_hashes(ids, info.block_size, root_hash(info.fingerprint, info.dtype, info.block_size, None))


def _holder(cluster: RunningApi, worker_id: str):
    from halfmoon.kvpool.cluster_index import HolderId

    return HolderId(worker_id, cluster.backend.manager.workers[worker_id].node_id)


def test_killing_the_holders_node_mid_fetch_recomputes_without_error_or_leak(cluster: RunningApi, nodes: LocalRayNodes,
                                                                             engine: Engine) -> None:
    """Issue 24, point 4 (last in this module: node B stays dead). The prefix is prefilled on
    node B; node B hangs (SIGSTOP) while the worker on node A pulls it, and is killed (SIGKILL)
    while that pull waits: A recomputes, the client gets the cold run's tokens, nothing leaks."""
    import ray

    workers = cluster.backend.manager.workers
    head = worker_load(cluster, "decode-0").node_id
    a = next(w for w in PREFILL if workers[w].node_id == head)
    b = next(w for w in PREFILL if w != a)
    tok = engine.tokenizer
    prefix = tok.encode("Context held only by the worker on node B, which is about to die. " * 10)[:80]
    assert len(prefix) == 80
    first, second = prefix + tok.encode(" First question?"), prefix + tok.encode(" Second question, please.")
    with _held(cluster, a):
        generate_all(cluster.grpc_target, [first], [2])  # prefilled on B
    start = worker_load(cluster, a)
    assert cluster.backend.prefix_match(second, None).best_holder == b

    nodes.pause_node(1)  # node B: connections still accepted by its kernel, nothing answers
    assert all(p.status() == psutil.STATUS_STOPPED for p in nodes.node_processes(1))
    results: list = []
    with _held(cluster, b):
        request = threading.Thread(target=lambda: results.append(generate_all(cluster.grpc_target, [second], [8])))
        request.start()
        wait_until(lambda: worker_load(cluster, a).fetches_in_flight == 1, 30, what=f"{a} pulling from node B")
        gone = nodes.kill_node(1)
        request.join(300)
    assert not any(is_alive(p) for p in gone)
    assert results and results[0] == reference(engine, [second], [8])  # no error, a cold run's tokens
    end = worker_load(cluster, a)
    seen = f"{a}: {start} -> {end}"
    assert (end.fetches_in_flight, end.fetch_failures - start.fetch_failures) == (0, 1), seen
    assert end.blocks_fetched_remote == start.blocks_fetched_remote, seen
    assert end.prompt_tokens_computed - start.prompt_tokens_computed == len(second), seen  # recomputed it all
    wait_until(lambda: worker_load(cluster, "decode-0").requests == 0, what="decode-0 idle")
    for wid in (a, "decode-0"):  # no block of the failed pull or the request is left held
        report = ray.get(workers[wid].api.handle.check_integrity.remote(), timeout=30)
        assert report.requests == 0 and report.reservations == 0, report
    wait_until(lambda: not workers[b].alive, 30, what=f"the Conductor to see {b} down")


class _held:
    """A fake 1000 s job on `worker_id`'s ledger while inside: the router sends work elsewhere."""

    def __init__(self, cluster: RunningApi, worker_id: str) -> None:
        self.ledger = cluster.backend.manager.workers[worker_id].pending

    def __enter__(self) -> None:
        self.ledger.add(PendingPrefill("hold", 0, math.inf, 1e6, time.monotonic()))

    def __exit__(self, *exc: object) -> None:
        self.ledger.finish("hold", time.monotonic())
