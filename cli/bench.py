"""`halfmoon bench NAME ...`: run one benchmark of `bench/` with its own arguments."""

from __future__ import annotations

import argparse
import importlib

# Benchmark name -> its module in bench/ (each has `main(argv) -> int`).
BENCHMARKS = {
    "engine": "bench.engine_bench",
    "linear": "bench.linear_bench",
    "kvpool": "bench.kvpool_bench",
    "transport": "bench.transport_bench",
    "load": "bench.api_load",
    "serve": "bench.serve_bench",
    "sim": "bench.sim_bench",
    "sim-vs-live": "bench.sim_vs_live",
    "dashboard": "bench.dashboard_bench",
    "chaos": "bench.chaos_bench",
    "soak": "bench.soak_bench",
    "make-trace": "bench.make_trace",  # not a benchmark: writes a synthetic Mooncake trace to replay
}


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=list(BENCHMARKS), help="which benchmark")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(BENCHMARKS[args.name]).main(args.rest)
