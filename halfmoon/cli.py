"""`halfmoon` command line: generate, serve, client, profile, bench."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

# Before grpc is imported: gRPC's fork handlers only matter to a child that goes on using gRPC
# without exec. Ray starts its processes with fork + exec while the driver's gRPC threads run,
# and with the handlers on, gRPC logs "Other threads are currently calling into gRPC, skipping
# fork() handlers" for each one (ray-project/ray#24917) — noise in `halfmoon serve`'s first lines.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from core.errors import HalfmoonError  # noqa: E402


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine."""
    p.add_argument("--model", default="smollm2", help="alias (smollm2), GGUF file or HF folder")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute/KV dtype")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache size in GiB")
    p.add_argument("--num-blocks", type=int, default=None, help="KV cache size in blocks (overrides GB)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    p.add_argument("--max-num-seqs", type=int, default=64, help="max concurrent requests")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: model's)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--host-cache-gb", type=float, default=0.0, help="host DRAM KV tier in GiB (0 = off)")
    p.add_argument("--host-cache-name", default=None,
                   help="shared-memory arena name; workers of a node using one name share it")
    p.add_argument("--disk-cache-dir", default=None, help="directory of the disk KV tier (off if unset)")
    p.add_argument("--disk-cache-gb", type=float, default=0.0, help="disk KV tier size in GiB")


def engine_config(args: argparse.Namespace):  # -> EngineConfig (import kept lazy: torch is slow)
    from engine.config import EngineConfig

    return EngineConfig(model=args.model, dtype=args.dtype, block_size=args.block_size,
                        kv_cache_gb=args.kv_cache_gb, num_blocks=args.num_blocks,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        num_threads=args.threads, host_cache_gb=args.host_cache_gb,
                        host_cache_name=args.host_cache_name, disk_cache_dir=args.disk_cache_dir,
                        disk_cache_gb=args.disk_cache_gb)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="halfmoon", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from halfmoon import client_cmd, generate_cmd, profile_cmd, serve_cmd

    generate_cmd.add_parser(sub)
    serve_cmd.add_parser(sub)
    client_cmd.add_parser(sub)
    profile_cmd.add_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks (each measures its baseline in the same run)")
    bench.add_argument("name", choices=["engine", "linear", "kvpool", "transport", "load", "serve"],
                       help="which benchmark")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    return parser


def run_bench(args: argparse.Namespace) -> int:
    if args.name == "linear":
        from bench import linear_bench

        return linear_bench.main(args.rest)
    if args.name == "transport":
        from bench import transport_bench

        return transport_bench.main(args.rest)
    if args.name == "load":
        from bench import api_load

        return api_load.main(args.rest)
    if args.name == "serve":
        from bench import serve_bench

        return serve_bench.main(args.rest)
    if args.name == "kvpool":
        from bench import kvpool_bench

        return kvpool_bench.main(args.rest)
    from bench import engine_bench

    return engine_bench.main(args.rest)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "bench":
            return run_bench(args)
        return args.func(args)
    except HalfmoonError as e:
        print(f"halfmoon: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
