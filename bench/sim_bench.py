"""`halfmoon bench sim`: how fast the simulator replays, against issue 20's targets.

Three measurements on synthetic conversation traces in the Mooncake format (sim/conversations.py:
sessions opening on one of a few shared system prompts, each turn extending its conversation, so
prefixes are reused as in the FAST'25 trace):

    one shape,  12k requests   target < 10 s    (the public conversation trace has 12,031)
    one shape, 100k requests   target < 60 s
    sim sweep,  16 shapes of the 12k trace      target < 120 s

Each is timed in this process (one core) with the built-in `llama3-8b-h100` profile and printed
with its ratio to the target; `--quick` runs 1/10 of each size (tests and CI).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conductor.cost_model import CostModel
from sim.cluster import SimConfig, simulate
from sim.conversations import conversation_trace, write_trace
from sim.sweep import Grid, sweep
from sim.workload import load

PROFILE = Path(__file__).resolve().parents[1] / "sim" / "profiles" / "llama3-8b-h100.json"
TARGETS = {"shape_12k": 10.0, "shape_100k": 60.0, "sweep_16x12k": 120.0}


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
    args = p.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
