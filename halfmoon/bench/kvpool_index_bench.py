"""Cluster index lookups/s: 64-block prompts against Redis holding 1M block entries.

Fills Redis through the real `ClusterIndex.publish` path with `num_entries` (block, holder)
entries spread over 8 holders: chains of `prompt_blocks` blocks, each published whole by one
holder and its first half by a second holder. Then one reader `ClusterIndex` looks up a fixed mix
of prompts (half hits: a chain's prefix followed by unknown blocks; half misses):

* single stream: one lookup at a time for `seconds` -> latency p50/p99 and lookups/s of one
  caller (bound by the round trip: on this VM a wake-up across vCPUs alone costs ~100 us);
* concurrent: `threads` callers sharing the one `ClusterIndex` (as a router's request threads
  would) for `seconds` -> `lookups_per_s`, the index's capacity, compared with the target.

Baseline in the same run, same prompts, same concurrency: a bare redis-py `MGET` of the 64 block
keys (no liveness, no prefix matching, no result), so `ratio_vs_mget` is what the index's
bookkeeping costs or saves.

    python -m halfmoon.bench.kvpool_index_bench [--entries N] [--seconds S] [--threads T] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import NamedTuple

import redis

from halfmoon.kvpool.cluster_index import ClusterIndex, HolderId
from halfmoon.kvpool.redis_server import EmbeddedRedis
from halfmoon.kvpool.tiers import Tier

TARGET_LOOKUPS_PER_S = 5000.0
NUM_HOLDERS = 8
# A (hit, miss) prompt pool this large keeps the loop from measuring one hot key set.
NUM_QUERIES = 4096

Query = tuple[list[bytes], int]  # (prompt block hashes, expected best match length)


def make_chains(num_entries: int, prompt_blocks: int, seed: int) -> list[list[bytes]]:
    """Enough chains of random 16-byte hashes that full + half publication gives num_entries."""
    per_chain = prompt_blocks + prompt_blocks // 2
    num_chains = max(1, num_entries // per_chain)
    raw = random.Random(seed).randbytes(16 * prompt_blocks * num_chains)
    step = 16 * prompt_blocks
    return [[raw[o:o + 16] for o in range(c * step, (c + 1) * step, 16)]
            for c in range(num_chains)]


def load(holders: Sequence[ClusterIndex], chains: list[list[bytes]]) -> int:
    """Publish chain c whole at holder c % n and its first half at holder (c + 1) % n, in
    tier c % 3; returns the number of entries written."""
    entries = 0
    for i, index in enumerate(holders):
        for tier in Tier:
            mine = [c for c in range(len(chains)) if c % len(Tier) == tier]
            full = [h for c in mine if c % len(holders) == i for h in chains[c]]
            half = [h for c in mine if (c + 1) % len(holders) == i
                    for h in chains[c][:len(chains[c]) // 2]]
            index.publish(full + half, tier)
            entries += len(full) + len(half)
    return entries


def make_queries(chains: list[list[bytes]], prompt_blocks: int, seed: int) -> list[Query]:
    """Half hits (a random prefix of a chain, then unknown blocks), half misses."""
    rng = random.Random(seed + 1)
    queries = []
    for q in range(NUM_QUERIES):
        if q % 2:
            queries.append(([rng.randbytes(16) for _ in range(prompt_blocks)], 0))
            continue
        keep = rng.randint(1, prompt_blocks)
        tail = [rng.randbytes(16) for _ in range(prompt_blocks - keep)]
        queries.append((rng.choice(chains)[:keep] + tail, keep))
    return queries


class Timing(NamedTuple):
    """One timed run: every call's wall latency, and the CPU both sides spent per call."""

    latencies_ns: list[int]  # sorted
    per_s: float  # calls / wall time of the run
    client_cpu_us: float  # this process's CPU per call
    server_us: float  # Redis wall time per call of the measured command (INFO commandstats)

    def percentile_ms(self, q: float) -> float:
        lat = self.latencies_ns
        return lat[min(len(lat) - 1, int(q * len(lat)))] / 1e6


def timed_run(call: Callable[[list[bytes]], object], queries: list[Query], seconds: float,
              threads: int, client: redis.Redis, command: str) -> Timing:
    """`threads` callers each call `call(prompt)` over the queries, one at a time."""
    latencies: list[list[int]] = [[] for _ in range(threads)]
    deadline = time.perf_counter() + seconds

    def caller(k: int) -> None:
        mine, n = latencies[k], k
        while time.perf_counter() < deadline:
            start = time.perf_counter_ns()
            call(queries[n % len(queries)][0])
            mine.append(time.perf_counter_ns() - start)
            n += threads

    server_before, cpu_start, wall_start = (_command_usec(client, command), time.process_time(),
                                            time.perf_counter())
    workers = [threading.Thread(target=caller, args=(k,)) for k in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    wall, cpu = time.perf_counter() - wall_start, time.process_time() - cpu_start
    usec, calls = (a - b for a, b in zip(_command_usec(client, command), server_before))
    merged = sorted(lat for per_caller in latencies for lat in per_caller)
    return Timing(merged, len(merged) / wall, cpu * 1e6 / len(merged), usec / max(1, calls))


def _command_usec(client: redis.Redis, command: str) -> tuple[int, int]:
    """(total usec, calls) Redis has spent in `command` so far."""
    stats = client.info("commandstats").get(f"cmdstat_{command}", {"usec": 0, "calls": 0})
    return int(stats["usec"]), int(stats["calls"])


def check_answers(reader: ClusterIndex, queries: list[Query]) -> None:
    """The benchmark measures correct lookups: a sample must give the expected best length."""
    for prompt, expected in queries[:64]:
        best = reader.lookup(prompt).best
        got = best.length if best is not None else 0
        if got != expected:
            raise AssertionError(f"lookup returned best length {got}, expected {expected}")


def bench_lookups(url: str, num_entries: int = 1_000_000, prompt_blocks: int = 64,
                  seconds: float = 5.0, *, threads: int = 4, seed: int = 0) -> dict[str, object]:
    """Load `num_entries` entries into a fresh namespace at `url`, measure lookups, clean up."""
    namespace = f"b{uuid.uuid4().hex[:6]}"  # short, like the default "hm"
    # Long heartbeat TTLs: no heartbeat threads run, and nobody may expire mid-run.
    holders = [ClusterIndex(url, HolderId(f"w{i}", f"node{i // 2}"), namespace=namespace,
                            heartbeat_ttl_s=3600.0) for i in range(NUM_HOLDERS)]
    reader = ClusterIndex(url, HolderId("reader", "node-r"), namespace=namespace,
                          heartbeat_ttl_s=3600.0)
    client = redis.Redis.from_url(url)
    try:
        chains = make_chains(num_entries, prompt_blocks, seed)
        start = time.perf_counter()
        entries = load(holders, chains)
        load_s = time.perf_counter() - start
        queries = make_queries(chains, prompt_blocks, seed)
        check_answers(reader, queries)
        prefix = f"{namespace}:b:".encode()

        def mget(prompt: list[bytes]) -> object:
            return client.mget([prefix + h for h in prompt])
        runs = {(name, n): timed_run(call, queries, duration, n, client, command)
                for name, call, command, duration in (
                    ("index", reader.lookup, "evalsha", seconds),
                    ("mget", mget, "mget", seconds / 2))
                for n in (1, threads)}
        memory_mb = client.info("memory")["used_memory"] / 2**20
    finally:
        for holder in (*holders, reader):
            holder.close()
        _delete_namespace(client, namespace)
    return _report(runs, threads, entries, len(chains) * prompt_blocks, prompt_blocks, load_s,
                   memory_mb)


def _report(runs: dict[tuple[str, int], Timing], threads: int, entries: int, block_keys: int,
            prompt_blocks: int, load_s: float, memory_mb: float) -> dict[str, object]:
    single, concurrent = runs["index", 1], runs["index", threads]
    mget_single, mget_concurrent = runs["mget", 1], runs["mget", threads]
    return {"lookups_per_s": round(concurrent.per_s), "threads": threads,
            "single_stream_lookups_per_s": round(single.per_s),
            "p50_ms": round(single.percentile_ms(0.5), 3),
            "p99_ms": round(single.percentile_ms(0.99), 3),
            "client_cpu_us_per_lookup": round(single.client_cpu_us, 1),
            "server_us_per_lookup": round(single.server_us, 1),
            "entries": entries, "block_keys": block_keys, "prompt_blocks": prompt_blocks,
            "holders": NUM_HOLDERS, "load_s": round(load_s, 2),
            "redis_used_memory_mb": round(memory_mb, 1),
            "baseline_mget_per_s": round(mget_concurrent.per_s),
            "baseline_mget_single_stream_per_s": round(mget_single.per_s),
            "ratio_vs_mget": round(concurrent.per_s / mget_concurrent.per_s, 3),
            "ratio_vs_mget_single_stream": round(single.per_s / mget_single.per_s, 3),
            "target_lookups_per_s": TARGET_LOOKUPS_PER_S,
            "met": concurrent.per_s >= TARGET_LOOKUPS_PER_S}


def _delete_namespace(client: redis.Redis, namespace: str) -> None:
    batch: list[bytes] = []
    for key in client.scan_iter(match=f"{namespace}:*", count=5000):
        batch.append(key)
        if len(batch) >= 5000:
            client.unlink(*batch)
            batch.clear()
    if batch:
        client.unlink(*batch)


def format_line(r: dict[str, object]) -> str:
    """One human-readable line with the figures of `bench_lookups`."""
    return (f"kvpool index: {r['lookups_per_s']} lookups/s with {r['threads']} callers "
            f"(bare MGET {r['baseline_mget_per_s']}/s, ratio {r['ratio_vs_mget']}); one caller "
            f"{r['single_stream_lookups_per_s']}/s, p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms "
            f"(bare MGET {r['baseline_mget_single_stream_per_s']}/s, ratio "
            f"{r['ratio_vs_mget_single_stream']}; client CPU {r['client_cpu_us_per_lookup']} us, "
            f"Redis {r['server_us_per_lookup']} us per lookup); {r['prompt_blocks']}-block "
            f"prompts over {r['entries']} entries / {r['holders']} holders, loaded in "
            f"{r['load_s']} s, Redis {r['redis_used_memory_mb']} MB; target "
            f"{r['target_lookups_per_s']:.0f}/s {'met' if r['met'] else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m halfmoon.bench.kvpool_index_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", type=int, default=1_000_000)
    p.add_argument("--prompt-blocks", type=int, default=64)
    p.add_argument("--seconds", type=float, default=5.0,
                   help="length of each index run (baseline runs take half)")
    p.add_argument("--threads", type=int, default=4, help="concurrent callers")
    p.add_argument("--redis-url", help="use this Redis instead of an embedded one")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    options = {"num_entries": args.entries, "prompt_blocks": args.prompt_blocks,
               "seconds": args.seconds, "threads": args.threads}
    if args.redis_url:
        result = bench_lookups(args.redis_url, **options)
    else:
        with EmbeddedRedis() as server:
            result = bench_lookups(server.url, **options)
    print(json.dumps(result) if args.json else format_line(result))
    return 0  # absolute speed is reported, never a pass/fail (the machine is shared and noisy)


if __name__ == "__main__":
    sys.exit(main())
