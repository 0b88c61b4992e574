"""`halfmoon bench sim`: how fast the simulator replays, against issue 20's targets.

Three measurements on synthetic conversation traces in the Mooncake format (sim/conversations.py:
sessions opening on one of a few shared system prompts, each turn extending its conversation, so
prefixes are reused as in the FAST'25 trace):

    one shape,  12k requests   target < 10 s    (the public conversation trace has 12,031)
    one shape, 100k requests   target < 60 s
    sim sweep,  16 shapes of the 12k trace      target < 120 s

Each is timed in this process (one core) with the built-in `llama3-8b-h100` profile and printed
with its ratio to the target; `--quick` runs 1/10 of each size (tests and CI).

`--cli` times the command itself instead (issue 45), as a user runs it, start-up included:

    halfmoon sim --trace T --prefill 1 --decode 1 --profile llama3-8b-h100 --json   target < 10 s

with every other flag at its default, the offline optimum's budgets included (--optimum-seconds,
--optimum-nodes), on `--trace T` (e.g. FAST'25's conversation_trace.jsonl, 12,031 requests) or,
without one, a 12,031-request trace of `halfmoon bench make-trace` (seed 1). It prints the wall
time against the target, the replay's and the optimum's own seconds, and what the optimum's
budget bounded. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from halfmoon.conductor.cost_model import CostModel
from halfmoon.sim.cluster import SimConfig, simulate
from halfmoon.sim.conversations import conversation_trace, write_trace
from halfmoon.sim.sweep import Grid, sweep
from halfmoon.sim.workload import load

PROFILE = Path(__file__).resolve().parents[1] / "sim" / "profiles" / "llama3-8b-h100.json"
TARGETS = {"shape_12k": 10.0, "shape_100k": 60.0, "sweep_16x12k": 120.0}
CLI_TARGET_S = 10.0
CLI_REQUESTS, CLI_SEED = 12_031, 1  # the FAST'25 conversation trace's size
CLI_ARGS = ("--prefill", "1", "--decode", "1", "--profile", "llama3-8b-h100", "--json")


def timed_shape(path: Path, cost: CostModel) -> dict[str, Any]:
    start = time.perf_counter()
    workload = load(path)
    result = simulate(workload, SimConfig(prefill=2, decode=2, host_tokens=1 << 20), cost)
    return {"requests": len(workload.requests), "seconds": round(time.perf_counter() - start, 2),
            "sim_seconds": round(result.wall_s, 2)}


def timed_sweep(path: Path, cost: CostModel) -> dict[str, Any]:
    start = time.perf_counter()
    workload = load(path)
    grid = Grid(5, (65536, 262144), (0, 1 << 20))  # 4 P:D splits x 2 x 2 = 16 shapes
    result = sweep(workload, grid, SimConfig(), cost)
    return {"requests": len(workload.requests), "shapes": len(result["rows"]),
            "seconds": round(time.perf_counter() - start, 2),
            "best": f"{result['best']['prefill']}P{result['best']['decode']}D"}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="halfmoon bench sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1/10 of each size (tests, CI); not for recorded figures")
    p.add_argument("--json", action="store_true")
    p.add_argument("--cli", action="store_true",
                   help="time `halfmoon sim` itself at its defaults (start-up and offline optimum included)")
    p.add_argument("--trace", default=None,
                   help="--cli: the trace to replay (default: a synthetic 12,031-request one)")
    args = p.parse_args(argv)
    if args.cli or args.trace:
        row = cli_run(Path(args.trace) if args.trace else None, args.quick)
        print(json.dumps({"cli": row}) if args.json else render_cli(row))
        return 0
    scale = 10 if args.quick else 1
    cost = CostModel.load(PROFILE)
    with tempfile.TemporaryDirectory(prefix="halfmoon-sim-bench-") as tmp:
        small = write_trace(conversation_trace(12_000 // scale, seed=1), Path(tmp) / "12k.jsonl")
        large = write_trace(conversation_trace(100_000 // scale, seed=2), Path(tmp) / "100k.jsonl")
        rows = {"shape_12k": timed_shape(small, cost), "shape_100k": timed_shape(large, cost),
                "sweep_16x12k": timed_sweep(small, cost)}
    for name, row in rows.items():
        row["target_s"] = TARGETS[name] / scale
        row["ratio"] = round(row["seconds"] / row["target_s"], 3)
        row["met"] = row["seconds"] < row["target_s"]
    print(json.dumps(rows) if args.json else render(rows, args.quick))
    return 0


def render(rows: dict[str, dict[str, Any]], quick: bool) -> str:
    lines = [f"halfmoon bench sim{' (--quick: 1/10 sizes and targets)' if quick else ''}: one core, "
             "llama3-8b-h100 profile, 2P2D with a host tier",
             f"{'measurement':16} {'requests':>9} {'seconds':>8} {'target':>7} {'ratio':>6}  verdict"]
    for name, row in rows.items():
        lines.append(f"{name:16} {row['requests']:>9} {row['seconds']:>8.2f} {row['target_s']:>7.1f} "
                     f"{row['ratio']:>6.2f}  {'met' if row['met'] else 'MISSED'}")
    return "\n".join(lines)


def cli_run(trace: Path | None, quick: bool = False) -> dict[str, Any]:
    """`halfmoon sim` at its defaults on `trace` (None: a synthetic one, 1/10 the size when
    `quick`), in a process of its own: its wall time against CLI_TARGET_S and its report."""
    requests = CLI_REQUESTS // (10 if quick else 1)
    with tempfile.TemporaryDirectory(prefix="halfmoon-sim-bench-") as tmp:
        path = trace if trace is not None else synthetic_trace(Path(tmp), requests)
        command = [sys.executable, "-m", "halfmoon.cli.main", "sim", "--trace", str(path), *CLI_ARGS]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"halfmoon sim failed ({done.returncode}):\n{done.stderr[-2000:]}")
    report = json.loads(done.stdout)
    optimum = report.get("optimum") or {}
    source = str(trace) if trace is not None else f"synthetic: make-trace --requests {requests} --seed {CLI_SEED}"
    return {"trace": source,
            "command": "halfmoon sim --trace TRACE " + " ".join(CLI_ARGS), "requests": report["requests"],
            "seconds": round(seconds, 2), "target_s": CLI_TARGET_S, "ratio": round(seconds / CLI_TARGET_S, 3),
            "met": seconds < CLI_TARGET_S, "replay_s": report["wall_s"], "optimum_s": optimum.get("search_s"),
            "optimum": {k: optimum.get(k) for k in ("served", "method", "best_schedule", "segments",
                                                    "inexact_segments", "bounded_by", "budget", "note")}}


def synthetic_trace(directory: Path, requests: int) -> Path:
    """The trace `halfmoon bench make-trace --requests N --seed CLI_SEED` writes (its default shape)."""
    from halfmoon.bench.make_trace import parse_args

    args = parse_args(["--requests", str(requests), "--seed", str(CLI_SEED)])
    return write_trace(conversation_trace(args.requests, args.seed, args.shape), directory / f"conversation-{requests}.jsonl")


def render_cli(row: dict[str, Any]) -> str:
    o = row["optimum"]
    budget = o.get("budget") or {}
    if o.get("served") is None:
        bound = "offline optimum: not run"
    elif o["method"] == "exact":
        bound = f"offline optimum: {o['served']} exact ({o['segments']} segments, none bounded)"
    else:
        bound = (f"offline optimum: {o['best_schedule']}..{o['served']} (upper bound): "
                 f"{o['bounded_by']['time']} of {o['segments']} segments bounded by the time budget "
                 f"({budget.get('seconds')} s), {o['bounded_by']['nodes']} by the node budget ({budget.get('nodes')} nodes)")
    return "\n".join([
        f"halfmoon bench sim --cli: `{row['command']}` (every other flag at its default)",
        f"  trace: {row['trace']} ({row['requests']} requests)",
        (f"  wall {row['seconds']:.2f} s, target < {row['target_s']:g} s, ratio {row['ratio']:.2f}: "
         f"{'met' if row['met'] else 'MISSED'}"),
        f"  of which: replay {row['replay_s']:.2f} s, offline optimum {row['optimum_s'] or 0:.2f} s",
        f"  {bound}",
        *([f"  {o['note']}"] if o.get("note") else []),
    ])


if __name__ == "__main__":
    sys.exit(main())
