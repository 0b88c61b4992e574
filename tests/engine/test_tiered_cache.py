"""Issue 3, point 2: after the device evicts a prefix, the next serve hits in host or disk."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from halfmoon.engine.engine import Engine
from halfmoon.core.params import SamplingParams
from halfmoon.kvpool.redis_server import EmbeddedRedis
from halfmoon.kvpool.remote import InProcessReader
from halfmoon.kvpool.tiers import Tier

BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2 fp32, block_size 16
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def gb(blocks: int) -> float:
    return blocks * BLOCK_BYTES / 2**30 + 1e-9


def serve(engine: Engine, ids: list[int]) -> tuple[list[int], int, int]:
    """(outputs, prompt tokens computed, prompt tokens promoted from host/disk)."""
    stats = engine.scheduler.stats
    computed, promoted = stats.prompt_tokens_computed, stats.prompt_tokens_promoted
    out = engine.generate([ids], PARAMS, cache_salt="tiers")[0].output_ids
    assert engine.tiers.flush(30), "the write-behind did not drain"  # spills and index calls landed
    return out, stats.prompt_tokens_computed - computed, stats.prompt_tokens_promoted - promoted


def flood(engine: Engine, n: int) -> None:
    """Serve unrelated prompts until the device cache has recycled every block."""
    for i in range(n):
        engine.generate([[2000 + 97 * i + j for j in range(100)]], PARAMS, cache_salt=f"flood-{i}")
    assert engine.tiers.flush(30), "the write-behind did not drain"


def prompt(engine: Engine) -> list[int]:
    return engine.tokenizer.encode("The tiered cache keeps prefixes warm. " * 12)[:84]  # 5 blocks + 4


@pytest.fixture
def tiered(make_engine, tmp_path: Path, request):
    host_blocks, disk_blocks = request.param
    engine = make_engine(num_blocks=16, host_cache_gb=gb(host_blocks),
                         disk_cache_dir=str(tmp_path / "disk") if disk_blocks else None,
                         disk_cache_gb=gb(disk_blocks))
    yield engine
    engine.close()


@pytest.mark.parametrize("tiered", [(64, 0)], indirect=True)
def test_evicted_prefix_hits_in_host_and_matches_a_cold_run(tiered: Engine) -> None:
    ids = prompt(tiered)
    cold, computed_cold, _ = serve(tiered, ids)
    assert computed_cold == len(ids)
    flood(tiered, 4)
    hashes = _hashes(tiered, ids)
    assert tiered.pool.get_computed_blocks(hashes) == [], "the device still holds the prefix"
    warm, computed_warm, promoted = serve(tiered, ids)
    assert promoted == 5 * 16 and computed_warm == len(ids) - 5 * 16
    assert warm == cold
    assert tiered.tiers.traffic.promoted_from_host == 5
    tiered.pool.check_integrity()
    tiered.tiers.host.check_integrity()


@pytest.mark.parametrize("tiered", [(64, 0)], indirect=True)
def test_the_engine_thread_does_not_wait_for_the_spill(tiered: Engine) -> None:
    """Issue 24, write-back off the hot path: with the host arena's puts held, the engine still
    serves and evicts; the spills land once the puts go through, and then hit."""
    ids = prompt(tiered)
    cold, _, _ = serve(tiered, ids)
    host, gate, entered = tiered.tiers.host, threading.Event(), threading.Event()
    put = host.put

    def held_put(*args, **kwargs):
        entered.set()
        assert gate.wait(60), "never released"
        return put(*args, **kwargs)

    host.put = held_put
    try:
        for i in range(4):  # as flood(), without its flush
            tiered.generate([[2000 + 97 * i + j for j in range(100)]], PARAMS, cache_salt=f"flood-{i}")
        assert entered.is_set() and tiered.tiers.traffic.demoted_to_host == 0  # evicted, not yet put
        assert tiered.pool.get_computed_blocks(_hashes(tiered, ids)) == []
    finally:
        gate.set()
        host.__dict__.pop("put", None)
    assert tiered.tiers.flush(30)
    assert tiered.tiers.traffic.demoted_to_host > 0
    warm, computed, promoted = serve(tiered, ids)
    assert (warm, promoted, computed) == (cold, 5 * 16, len(ids) - 5 * 16)
    tiered.tiers.host.check_integrity()


@pytest.mark.parametrize("tiered", [(2, 64)], indirect=True)
def test_prefix_pushed_down_to_disk_still_hits(tiered: Engine) -> None:
    ids = prompt(tiered)
    cold, _, _ = serve(tiered, ids)
    flood(tiered, 6)  # device -> host (2 slots) -> disk
    warm, computed_warm, promoted = serve(tiered, ids)
    assert promoted == 5 * 16 and computed_warm == len(ids) - 5 * 16
    assert warm == cold
    assert tiered.tiers.traffic.promoted_from_disk >= 3
    tiered.tiers.disk.check_integrity()


def test_spilled_blocks_are_found_by_the_index_served_to_another_node_and_promoted_on_a_hit(
        make_engine, tmp_path: Path) -> None:
    """Issue 24, tier spill: device -> host -> disk, each move announced to the cluster index; a
    worker on another node finds the blocks there and pulls them from the holder's lower tiers;
    the holder's own hit promotes them back to its device (the index says DEVICE again)."""
    with EmbeddedRedis() as redis:
        reader = InProcessReader()
        holder = make_engine(remote=reader, num_blocks=16, host_cache_gb=gb(2), disk_cache_dir=str(tmp_path / "disk"),
                             disk_cache_gb=gb(64), redis_url=redis.url, worker_id="holder", node_id="node-a")
        other = make_engine(remote=reader, num_blocks=32, redis_url=redis.url, worker_id="other", node_id="node-b")
        try:
            ids = prompt(holder)
            cold, _, _ = serve(holder, ids)
            hashes, index = _hashes(holder, ids)[:5], holder.tiers.index
            assert index.lookup(hashes).match(index.holder).blocks_per_tier == (5, 0, 0)
            flood(holder, 6)
            spilled = index.lookup(hashes).match(index.holder)
            assert spilled.length == 5 and spilled.blocks_per_tier[0] == 0 and spilled.blocks_per_tier[2] >= 3
            assert spilled.tier is Tier.DISK
            before = other.scheduler.stats.prompt_tokens_computed
            assert other.generate([ids], PARAMS, cache_salt="tiers")[0].output_ids == cold
            assert other.tiers.traffic.fetched_remote == 5
            assert other.scheduler.stats.prompt_tokens_computed - before == len(ids) - 5 * 16
            warm, computed, promoted = serve(holder, ids)
            assert (warm, computed, promoted) == (cold, len(ids) - 5 * 16, 5 * 16)
            assert index.lookup(hashes).match(index.holder).blocks_per_tier[0] == 5
            for engine in (holder, other):
                engine.pool.check_integrity()
            holder.tiers.host.check_integrity()
            holder.tiers.disk.check_integrity()
        finally:
            other.close()
            holder.close()


def _hashes(engine: Engine, ids: list[int]) -> list[bytes]:
    from halfmoon.kvpool.block_hash import block_hashes, root_hash  # noqa: PLC0415

    dtype = str(engine.config.torch_dtype).removeprefix("torch.")
    root = root_hash(engine.model_config.fingerprint, dtype, engine.config.block_size, "tiers")
    return block_hashes(ids, engine.config.block_size, root)
