"""`halfmoon bench NAME ...`: run one benchmark of `bench/` with its own arguments."""

from __future__ import annotations

import argparse
import importlib

# Benchmark name -> its module in bench/ (each has `main(argv) -> int`).
BENCHMARKS = {
    "engine": "halfmoon.bench.engine_bench",
    "linear": "halfmoon.bench.linear_bench",
    "kvpool": "halfmoon.bench.kvpool_bench",
    "transport": "halfmoon.bench.transport_bench",
    "load": "halfmoon.bench.api_load",
    "serve": "halfmoon.bench.serve_bench",
    "sim": "halfmoon.bench.sim_bench",
    "sim-vs-live": "halfmoon.bench.sim_vs_live",
    "dashboard": "halfmoon.bench.dashboard_bench",
    "chaos": "halfmoon.bench.chaos_bench",
    "soak": "halfmoon.bench.soak_bench",
    "first-run": "halfmoon.bench.first_run_bench",
    "sampling": "halfmoon.bench.sampling_bench",
    "choices": "halfmoon.bench.choices_bench",
    "constraints": "halfmoon.bench.constraints_bench",
    "lora": "halfmoon.bench.lora_bench",
    "planner-sim": "halfmoon.bench.planner_sim",
    "make-trace": "halfmoon.bench.make_trace",  # not a benchmark: writes a synthetic Mooncake trace to replay
}


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=list(BENCHMARKS), help="which benchmark")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(BENCHMARKS[args.name]).main(args.rest)
