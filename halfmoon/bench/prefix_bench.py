"""`halfmoon bench serve --nodes K --prefill N --decode M`: cluster-wide prefix hits across Ray
nodes (issue 24), with the local-only baseline and the workload's infinite-cache bound.

One multi-node Ray cluster on this machine (bench/ray_nodes.py: a head and K-1 more raylets, the
prefill workers spread over the nodes by their `prefill` resource, the decode workers on the
head) serves the same replay twice, each time a fresh `halfmoon serve --ray-address` (fresh
workers, fresh embedded Redis index, admission off: every request is served):

    cluster-wide   a prefix held by any worker, on any node and tier, is pulled over the KV
                   transport (Mooncake Algorithm 1 prices the pull against recomputing it)
    local-only     the same with --no-remote-fetch: each worker reuses only its own tiers (the
                   router still sends a prompt to a worker that holds its prefix, when it pays)

Per system: prefix hit rate (cached / prompt tokens, what the server reported per request),
prefill tokens saved (the cached tokens), TTFT p50 / p90, blocks the prefill workers pulled from
another worker (the server's /metrics). The bound is the replay's infinite-cache hit rate: each
prompt's leading 16-token blocks that any earlier prompt had (the last token always computed).

`--spill` (issue 24, point 3) is the tiers' experiment instead, on one node: the same replay
against `halfmoon serve` with its default tier sizes (the device tier of --kv-cache-gb, the host
tier of --host-cache-gb that the device tier's evictions spill to) and against the device tier
alone (`--host-cache-gb 0`), with the replay's working set (distinct 16-token blocks) next to the
device tier's size and the blocks each tier gave back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from halfmoon.bench.ray_nodes import LocalRayNodes
from halfmoon.bench.report import Progress, machine_info, utc_now
from halfmoon.bench.serve_args import workloads
from halfmoon.bench.serve_bench import ReplayOptions, System, replay, serving
from halfmoon.bench.serve_metrics import Slo, request_rows, summarize
from halfmoon.bench.workload import Workload
from halfmoon.kvpool.block_hash import block_hashes, root_hash

BLOCK_SIZE = 16  # `halfmoon serve`'s default --block-size: the bound counts blocks like the server
CLUSTER_WIDE, LOCAL_ONLY = "cluster-wide", "local-only"
DEFAULT_TIERS, DEVICE_ONLY = "default tiers", "device only"
BOUND_TARGET = 0.95  # issue 24: cluster-wide hit rate >= 95% of the single-pool bound
SPILL_TARGET = 0.90  # issue 24: serve's default tiers, spill on: >= 90% of the infinite-cache bound
SERVE_ARGS = "--worker-threads 1 --admission none"
_SAMPLE = re.compile(r'^(halfmoon_worker_\w+)\{([^}]*)\}\s+(\S+)$', re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
HEALTH_WAIT_S = 2.5  # the Conductor refreshes the workers' counters every second


@dataclass(frozen=True, slots=True)
class Shape:
    """Ray nodes and workers: `prefill` workers spread over `nodes`, the decode workers on the head."""

    nodes: int
    prefill: int
    decode: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.prefill < 1 or self.decode < 1:
            raise ValueError(f"--nodes, --prefill and --decode must be >= 1, got {self}")
        if self.nodes > self.prefill + self.decode:
            raise ValueError(f"{self.nodes} nodes for {self.prefill + self.decode} workers: a node would be empty")

    def resources(self) -> list[dict[str, float]]:
        """Each node's Ray resources: prefill workers round-robin from the last node (so with
        more nodes than one, the head is not the only prefill node), decode ones on the head."""
        nodes: list[dict[str, float]] = [{} for _ in range(self.nodes)]
        for i in range(self.prefill):
            node = nodes[(self.nodes - 1 - i) % self.nodes]
            node["prefill"] = node.get("prefill", 0) + 1
        nodes[0]["decode"] = self.decode
        return nodes


def infinite_cache_bound(workload: Workload, block_size: int = BLOCK_SIZE) -> dict[str, Any]:
    """Hit rate with one pool of unbounded size: per request in arrival order, its leading
    reusable blocks ((len - 1) // block_size at most) already seen in an earlier request."""
    root = root_hash("bound", "float32", block_size, None)
    seen: set[bytes] = set()
    hit = total = 0
    for request in workload.requests:
        hashes = block_hashes(list(request.prompt_ids), block_size, root)
        usable = hashes[: (len(request.prompt_ids) - 1) // block_size]
        lead = next((i for i, h in enumerate(usable) if h not in seen), len(usable))
        hit += lead * block_size
        total += len(request.prompt_ids)
        seen.update(hashes)
    return {"hit_rate": hit / total if total else None, "cached_tokens": hit, "prompt_tokens": total,
            "working_set_tokens": len(seen) * block_size}


def system_args(base: str, address: str, shape: Shape, local_only: bool) -> str:
    """`halfmoon serve` flags of one system (later flags win over `base`'s)."""
    args = f"{base} {SERVE_ARGS} --ray-address {address} --prefill {shape.prefill} --decode {shape.decode}"
    return args + (" --no-remote-fetch" if local_only else "")


def tier_counters(http_url: str) -> dict[str, float]:
    """From the server's /metrics once the Conductor's health loop has seen the replay's last
    steps: blocks the workers pulled from other workers (`fetched`) and served to them
    (`served`), prefix blocks they found in their host and disk tiers, and the largest device
    tier of a worker in blocks (`device_blocks`)."""
    time.sleep(HEALTH_WAIT_S)
    with urllib.request.urlopen(f"{http_url}/metrics", timeout=10) as response:
        return worker_counters(response.read().decode())


def worker_counters(text: str) -> dict[str, float]:
    """`tier_counters` of a Prometheus exposition (labels in any order)."""
    out = {"fetched": 0.0, "served": 0.0, "from_host": 0.0, "from_disk": 0.0}
    device: dict[str, float] = {}
    for name, labels, value in _SAMPLE.findall(text):
        label = dict(_LABEL.findall(labels))
        if name == "halfmoon_worker_prefix_blocks_total" and label.get("tier") == "remote":
            out["fetched"] += float(value)
        elif name == "halfmoon_worker_prefix_blocks_total" and label.get("tier") in ("host", "disk"):
            out[f"from_{label['tier']}"] += float(value)
        elif name == "halfmoon_worker_blocks_served_total":
            out["served"] += float(value)
        elif name == "halfmoon_worker_kv_blocks" and label.get("tier") == "device" and label.get("state") in ("used", "free"):
            device[label["worker"]] = device.get(label["worker"], 0.0) + float(value)
    out["device_blocks"] = max(device.values(), default=0.0)
    return out


def run_one(name: str, serve_args: str, workload: Workload, opts: ReplayOptions, log_dir: Path,
            say: Progress) -> dict[str, Any]:
    with serving(System(name, None, serve_args), log_dir, say) as (target, http_url):
        say(f"{name}: replaying {len(workload.requests)} requests over {workload.duration_s:.1f} s")
        records, makespan = asyncio.run(replay(target, workload, opts))
        assert http_url is not None
        counters = tier_counters(http_url)
    metrics = summarize(records, workload.duration_s, makespan, opts.slo)
    cached = sum(r.cached_tokens for r in records if r.status == "ok")
    say(f"{name}: {metrics['completed']}/{metrics['requests']} completed, hit rate "
        f"{_pct(metrics['prefix_hit_rate'])}, TTFT p50 {metrics['ttft_ms']['p50']} ms")
    return {"system": name, "serve_args": serve_args, "completed": metrics["completed"], "errors": metrics["errors"],
            "prefix_hit_rate": metrics["prefix_hit_rate"], "prefill_tokens_saved": cached,
            "blocks_fetched_remote": counters["fetched"], "blocks_served_remote": counters["served"],
            "blocks_from_host": counters["from_host"], "blocks_from_disk": counters["from_disk"],
            "device_tier_tokens": counters["device_blocks"] * BLOCK_SIZE,
            "ttft_ms": metrics["ttft_ms"], "metrics": metrics, "requests": request_rows(records)}


def run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    if args.spill:
        return run_spill(args, argv)
    say = Progress()
    shape = Shape(args.nodes, args.prefill, args.decode)
    ((_, workload),) = workloads(args)
    bound = infinite_cache_bound(workload)
    say(f"infinite-cache bound of the replay: {_pct(bound['hit_rate'])}")
    opts = ReplayOptions(Slo(args.ttft_slo_ms, args.tbt_slo_ms), args.send_slo, args.warmup, args.request_timeout,
                         not args.no_progress)
    log_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="halfmoon-prefix-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    with LocalRayNodes(shape.resources(), Path(tempfile.mkdtemp(prefix="hm-ray-")), num_cpus=2) as nodes:
        say(f"Ray: {shape.nodes} nodes at {nodes.address}: {shape.resources()}")
        for name, local in ((CLUSTER_WIDE, False), (LOCAL_ONLY, True)):
            serve_args = system_args(args.cluster_args, nodes.address, shape, local)
            runs.append(run_one(name, serve_args, workload, replace(opts, label=name), log_dir, say))
    result = summary(args, argv, shape, workload, bound, runs)
    (log_dir / "prefix_bench.json").write_text(json.dumps({**result, "runs": runs}, indent=1, default=str))
    print(json.dumps(result) if args.json else render(result))
    return 0 if all(r["errors"] == 0 and r["completed"] > 0 for r in runs) else 1


def run_spill(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """Serve's default tiers (spill on) vs the device tier alone, one node (module doc)."""
    say = Progress()
    ((_, workload),) = workloads(args)
    bound = infinite_cache_bound(workload)
    say(f"infinite-cache bound of the replay: {_pct(bound['hit_rate'])}; working set "
        f"{bound['working_set_tokens']:,} tokens")
    opts = ReplayOptions(Slo(args.ttft_slo_ms, args.tbt_slo_ms), args.send_slo, args.warmup, args.request_timeout,
                         not args.no_progress)
    log_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="halfmoon-spill-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    base = f"{args.cluster_args} {SERVE_ARGS} --prefill {args.prefill or 1} --decode {args.decode or 1}"
    runs = [run_one(name, base + extra, workload, replace(opts, label=name), log_dir, say)
            for name, extra in ((DEFAULT_TIERS, ""), (DEVICE_ONLY, " --host-cache-gb 0"))]
    result = spill_summary(args, argv, workload, bound, runs)
    (log_dir / "spill_bench.json").write_text(json.dumps({**result, "runs": runs}, indent=1, default=str))
    print(json.dumps(result) if args.json else render_spill(result))
    return 0 if all(r["errors"] == 0 and r["completed"] > 0 for r in runs) else 1


def spill_summary(args: argparse.Namespace, argv: Sequence[str] | None, workload: Workload,
                  bound: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["system"]: r for r in runs}
    limit = bound["hit_rate"]
    device_tokens = by[DEFAULT_TIERS]["device_tier_tokens"]
    return {"bench": "serve-spill", "date": utc_now(),
            "command": "halfmoon bench serve " + shlex.join(sys.argv[1:] if argv is None else argv),
            "machine": machine_info(1), "workload": workload.summary(), "infinite_cache_bound": bound,
            "device_tier_tokens": device_tokens,
            "working_set_over_device_tier": _ratio(bound["working_set_tokens"], device_tokens),
            "systems": {r["system"]: {k: v for k, v in r.items() if k not in ("metrics", "requests")} for r in runs},
            "default_tiers_vs_bound": _ratio(by[DEFAULT_TIERS]["prefix_hit_rate"], limit),
            "device_only_vs_bound": _ratio(by[DEVICE_ONLY]["prefix_hit_rate"], limit), "spill_target": SPILL_TARGET,
            "ttft_p50_default_over_device_only": _ratio(by[DEFAULT_TIERS]["ttft_ms"]["p50"],
                                                        by[DEVICE_ONLY]["ttft_ms"]["p50"])}


def render_spill(result: dict[str, Any]) -> str:
    b, s = result["infinite_cache_bound"], result["systems"]
    lines = [f"halfmoon bench serve --spill: {result['workload']['name']}, {result['workload']['requests']} requests",
             f"infinite-cache bound: hit rate {_pct(b['hit_rate'])} ({b['cached_tokens']} of {b['prompt_tokens']} "
             f"prompt tokens); working set {b['working_set_tokens']:,} tokens = "
             f"{_fmt(result['working_set_over_device_tier'], 2)}x a worker's device tier "
             f"({result['device_tier_tokens']:,.0f} tokens)",
             *_table(s, (DEFAULT_TIERS, DEVICE_ONLY), b["hit_rate"], ("host blk", "blocks_from_host"))]
    ratio = result["default_tiers_vs_bound"]
    verdict = "-" if ratio is None else ("met" if ratio >= result["spill_target"] else "MISSED")
    lines.append(f"default tiers hit / bound {_fmt(ratio, 3)} (target >= {result['spill_target']:g}: {verdict}); "
                 f"TTFT p50 default / device only {_fmt(result['ttft_p50_default_over_device_only'], 3)}")
    return "\n".join(lines)


def summary(args: argparse.Namespace, argv: Sequence[str] | None, shape: Shape, workload: Workload,
            bound: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["system"]: r for r in runs}
    wide, local = by[CLUSTER_WIDE], by[LOCAL_ONLY]
    limit = bound["hit_rate"]
    return {"bench": "serve-prefix", "date": utc_now(),
            "command": "halfmoon bench serve " + shlex.join(sys.argv[1:] if argv is None else argv),
            "machine": machine_info(1), "workload": workload.summary(),
            "shape": {"nodes": shape.nodes, "prefill": shape.prefill, "decode": shape.decode,
                      "node_resources": shape.resources()},
            "infinite_cache_bound": bound,
            "systems": {r["system"]: {k: v for k, v in r.items() if k not in ("metrics", "requests")} for r in runs},
            "cluster_wide_vs_bound": _ratio(wide["prefix_hit_rate"], limit), "bound_target": BOUND_TARGET,
            "local_only_vs_bound": _ratio(local["prefix_hit_rate"], limit),
            "ttft_p50_cluster_wide_over_local_only": _ratio(wide["ttft_ms"]["p50"], local["ttft_ms"]["p50"]),
            "ttft_p90_cluster_wide_over_local_only": _ratio(wide["ttft_ms"]["p90"], local["ttft_ms"]["p90"])}


def render(result: dict[str, Any]) -> str:
    b, s = result["infinite_cache_bound"], result["systems"]
    lines = [f"halfmoon bench serve (cluster-wide prefix hits): {result['workload']['name']}, "
             f"{result['workload']['requests']} requests; {result['shape']['nodes']} Ray nodes "
             f"{result['shape']['node_resources']}",
             f"infinite-cache bound: hit rate {_pct(b['hit_rate'])} ({b['cached_tokens']} of {b['prompt_tokens']} "
             "prompt tokens)",
             *_table(s, (CLUSTER_WIDE, LOCAL_ONLY), b["hit_rate"], ("fetched", "blocks_fetched_remote"))]
    lines.append(f"TTFT p50 cluster-wide / local-only: {_fmt(result['ttft_p50_cluster_wide_over_local_only'], 3)}; "
                 f"cluster-wide hit / bound {_fmt(result['cluster_wide_vs_bound'], 3)} (target >= {BOUND_TARGET:g}; "
                 "reported, not asserted)")
    return "\n".join(lines)


def _table(systems: dict[str, dict[str, Any]], names: tuple[str, ...], bound: float | None,
           blocks: tuple[str, str]) -> list[str]:
    """One row per system: hits against the bound, tokens saved, a block counter (its column
    title and key), TTFT."""
    title, key = blocks
    rows = [f"{'system':<15}{'done':>6}{'hit%':>8}{'of bound':>10}{'saved tok':>11}{title:>10}"
            f"{'TTFT p50':>10}{'TTFT p90':>10}"]
    for name in names:
        r = systems[name]
        rows.append(f"{name:<15}{r['completed']:>6}{_pct(r['prefix_hit_rate']):>8}"
                    f"{_fmt(_ratio(r['prefix_hit_rate'], bound), 3):>10}{r['prefill_tokens_saved']:>11}"
                    f"{r[key]:>10g}{_fmt(r['ttft_ms']['p50']):>10}{_fmt(r['ttft_ms']['p90']):>10}")
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"
