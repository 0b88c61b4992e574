"""`halfmoon bench soak`: open-loop load on a 1P2D cluster for `--minutes`, with faults at random
times from a seeded schedule, and the checks that must hold after it.

It starts `halfmoon serve --prefill 1 --decode 2` (embedded Redis, a host tier and a disk tier in a
small tmpfs it mounts), sends every unique prompt of the Mooncake-format `--trace` once through
the undisturbed cluster (each prompt's greedy reference), then replays the trace open loop at
`--rps` (looping it) for `--minutes`, while the faults of bench/soak_faults.py strike one at a time
(`--faults random`: each kind `12 * minutes / 30` times, at least once; `none`: no faults, the
baseline). Requests are greedy gRPC streams of at most `--max-tokens` tokens with ignore_eos.

It records every client outcome (ok / a documented refusal with its gRPC code / an error) and
every fault (kind, target, struck, lifted, serving again), samples RSS of every process and free
device blocks of every pool, and at the end, once the load drained: every worker's integrity
check (through Ray), the read leases and unpublished reservations left in the index, and whether
`/health`, `/metrics` and the dashboard's live view agree with the integrity checks.

Must hold (exit code 1 otherwise, each failure named): zero client-visible errors other than
documented refusals; every completed stream identical to its reference; RSS of every process
growing < 5% from the warm-up mark (minute 10, or a third of a shorter run) to the end; every
worker's integrity clean and nothing left in the index; the three views agree; restart-to-serving
not growing (the second half's median within 1.5x + 0.5 s of the first's); every fault recovered.
`--out` gets soak_bench.json (everything recorded) and `--plot` the timeline PNG.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from halfmoon.bench import soak_faults, soak_load, soak_report

SERVE_ARGS = ["--prefill", "1", "--decode", "2", "--worker-threads", "1", "--kv-transport", "tcp",
              "--admission", "none", "--num-blocks", "192", "--host-cache-gb", "0.004", "--disk-cache-gb", "0.01",
              "--dtype", "float32", "--quantization", "none"]  # greedy streams compared token for token
TMPFS_MIB = 48
DEFAULT_TRACE = Path(__file__).parent / "data" / "sample_trace.jsonl"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="halfmoon bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="load duration (fractional allowed)")
    p.add_argument("--faults", choices=("random", "none"), default="random")
    p.add_argument("--kinds", default=",".join(soak_faults.KINDS),
                   help=f"comma-separated fault kinds (default all: {', '.join(soak_faults.KINDS)})")
    p.add_argument("--seed", type=int, default=37)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL")
    p.add_argument("--requests", type=int, default=0, help="use the trace's first N lines only (0: all)")
    p.add_argument("--rps", type=float, default=1.0, help="mean arrival rate (the trace's times rescaled)")
    p.add_argument("--scale-tokens", type=int, default=24, help="tokens per trace hash block (of 512)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--warm-mark-min", type=float, default=10.0,
                   help="RSS growth is measured from this minute (a third of the run when it is shorter)")
    p.add_argument("--out", type=Path, default=None, help="write soak_bench.json here")
    p.add_argument("--plot", type=Path, default=None, help="write the timeline PNG here")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = set(kinds) - set(soak_faults.KINDS)
    if unknown:
        p.error(f"unknown fault kinds {sorted(unknown)}; choose from {', '.join(soak_faults.KINDS)}")
    if args.minutes <= 0 or args.rps <= 0:
        p.error("--minutes and --rps must be > 0")
    args.kind_list = kinds if args.faults == "random" else ()
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="halfmoon-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    say = (lambda _m: None) if args.json else (lambda m: print(f"[soak {time.strftime('%H:%M:%S')}] {m}",
                                                                 file=sys.stderr, flush=True))
    result = run(args, out, say)
    (out / "soak_bench.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("outcomes", "rss_samples", "block_samples")})
          if args.json
          else soak_report.render(result))
    return 1 if result["failed"] else 0


def run(args: argparse.Namespace, out: Path, say: Any) -> dict[str, Any]:
    from halfmoon.bench.chaos_bench import Server

    disk_dir = out / "disk-tier"
    kinds, excluded = list(args.kind_list), []
    why = soak_faults.mount_tmpfs(disk_dir, TMPFS_MIB)
    if why is not None:
        say(f"WARNING: {why}; the disk tier runs on {disk_dir} as it is and the enospc fault is EXCLUDED")
        excluded.append(f"enospc: {why}")
        kinds = [k for k in kinds if k != "enospc"]
    serve_args = [*SERVE_ARGS, "--disk-cache-dir", str(disk_dir)]
    try:
        server = Server(out / "serve.log", serve_args=serve_args)
        try:
            return _soak(args, server, disk_dir, tuple(kinds), excluded, serve_args, say)
        finally:
            server.stop()
    finally:
        if why is None:
            soak_faults.unmount(disk_dir)


def _soak(args: argparse.Namespace, server: Any, disk_dir: Path, kinds: tuple[str, ...], excluded: list[str],
          serve_args: list[str], say: Any) -> dict[str, Any]:
    arrivals, prompts = soak_load.trace_prompts(args.trace, args.scale_tokens, args.max_tokens, args.requests)
    say(f"cluster up at {server.grpc}; the undisturbed reference of {len(prompts)} prompts ...")
    want = soak_load.reference(server.grpc, prompts)
    duration = args.minutes * 60
    mark = min(args.warm_mark_min * 60, duration / 3)
    faults = soak_faults.schedule(kinds, args.minutes, args.seed, warm_up_s=min(30.0, duration / 6))
    say(f"load {args.rps} req/s for {args.minutes} min; {len(faults)} faults: "
        + ", ".join(f"{k} {sum(f.kind == k for f in faults)}" for k in kinds))
    t0 = time.monotonic()
    cluster = soak_faults.Cluster(server, disk_dir, random.Random(args.seed + 1), t0)
    sampler = soak_load.Sampler(server, t0)
    load = soak_load.OpenLoop(server.grpc, arrivals, prompts, args.rps, t0, duration)
    sampler.thread.start()
    load.thread.start()
    for f in faults:
        wait = f.at_s - cluster.now()
        if wait > 0:
            time.sleep(wait)  # the schedule's clock
        if cluster.now() >= duration - 5:
            f.note = "not struck: the load had ended (the faults before it took longer than their slots)"
            continue
        say(f"fault {f.kind} at {cluster.now():.1f} s ...")
        soak_faults.strike(cluster, f)
        say(f"  {f.kind} on {f.target}: serving again after {f.restart_to_serving_s} s {f.note}")
    drained = load.join(duration + 900)
    say(f"load done (drained: {drained}); integrity checks ...")
    time.sleep(3.0)  # let the workers' last loads reach the Conductor (its 1 s health loop) before reading views
    sampler.sample()
    sampler.stop()
    checks = soak_load.integrity(cluster)
    left = _index_leftovers(server)
    agreement = _agree(server, checks)
    cluster.close()
    return _result(args, load, want, faults, sampler, checks, left, agreement, mark, excluded, serve_args, kinds)


def _index_leftovers(server: Any, timeout_s: float = 40.0) -> dict[str, int]:
    """Leases and reservations in the index, polled until none (a killed holder's expire at their
    TTL, 30 s) or `timeout_s`: what is left then is leaked."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = soak_load.leases(server)
        if not any(left.values()) or time.monotonic() >= deadline:
            return left
        time.sleep(1.0)  # polling Redis until the TTLs ran out


def _agree(server: Any, checks: dict[str, Any], timeout_s: float = 15.0) -> dict[str, Any]:
    """The agreement, polled a little: the views read the workers' loads once a second."""
    deadline = time.monotonic() + timeout_s
    while True:
        a = soak_load.agreement(server, checks)
        if a["agree"] or time.monotonic() >= deadline:
            return a
        time.sleep(0.5)  # polling the Conductor's views


def _result(args: argparse.Namespace, load: soak_load.OpenLoop, want: list[list[int]], faults: list[Any],
            sampler: soak_load.Sampler, checks: dict[str, Any], left: dict[str, int], agreement: dict[str, Any],
            mark: float, excluded: list[str], serve_args: list[str], kinds: tuple[str, ...]) -> dict[str, Any]:
    outs = [o.as_dict() for o in load.outcomes]
    done = [o for o in load.outcomes if o.status == "ok"]
    mismatches = [o.index for o in done if o.tokens != want[o.index]]
    ttfts = sorted(o["ttft_s"] for o in outs if o["ttft_s"] is not None)
    fault_dicts = [f.as_dict() for f in faults]
    result: dict[str, Any] = {
        "benchmark": "soak", "minutes": args.minutes, "seed": args.seed, "rps": args.rps,
        "trace": str(args.trace.name), "faults_mode": args.faults, "serve_args": serve_args,
        "excluded": excluded, "fault_counts": {k: sum(f.kind == k for f in faults) for k in kinds},
        "counts": soak_report.outcome_counts(outs), "compared": len(done), "mismatches": len(mismatches),
        "mismatch_prompts": mismatches[:20],
        "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 3) if ttfts else None,
        "warm_mark_s": mark, "rss_growth": soak_report.rss_growth(sampler.rss, mark),
        "restarts": soak_report.restart_trend(fault_dicts), "integrity": checks, "leases": left,
        "agreement": agreement, "faults": fault_dicts, "outcomes": outs,
        "error_samples": [o for o in outs if o["status"].startswith("error")][:10],
        "rss_samples": sampler.rss, "block_samples": sampler.blocks}
    result["failed"] = soak_report.verdict(result)
    if args.plot is not None:
        soak_report.plot(result, sampler.rss, sampler.blocks, args.plot)
    return result
