"""`halfmoon sim`: replay a Mooncake-format trace through a simulated cluster that runs the
Conductor's own routing and admission (sim/). `halfmoon sim sweep` tries every prefill:decode split
of a worker budget and tier size and recommends the shape, with its Helm values.

    halfmoon sim --trace T.jsonl --prefill 2 --decode 2 --profile llama3-8b-h100
    halfmoon sim sweep --trace T.jsonl --workers 8 --profile llama3-8b-h100 --out sweep/

A flag not given is what `halfmoon serve` runs with no flags (conductor/serve_defaults.py): its
shape, block, chunk, batch and admission, and its tiers in the cost model's tokens (1 GiB of
device KV and the node's 4 GiB host tier per worker, no disk tier).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command's modules load when it runs, not when `halfmoon --help` is built
    from conductor.cost_model import CostModel
    from sim.cluster import SimConfig
    from sim.workload import Workload

Grids = tuple[tuple[int, ...], tuple[int, ...]]  # device, host tier sizes to sweep


def profile_names() -> list[str]:
    from sim.builtin import names

    return names()


def env_dests() -> set[str]:
    from cli.components import ADMISSION

    return ADMISSION.dests()


def add_parser(p: argparse.ArgumentParser) -> None:
    from cli.components import ADMISSION
    from cli.flags import add_flags
    from conductor.serve_defaults import serve_cluster

    served = serve_cluster()

    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("action", nargs="?", choices=("run", "sweep"), default="run",
                   help="run: one shape (default); sweep: every P:D split of --workers")
    p.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    p.add_argument("--speed", type=float, default=1.0, help="time scale: 2 = arrivals twice as dense")
    p.add_argument("--window-s", type=float, default=None, help="replay the first seconds only")
    p.add_argument("--max-input-tokens", type=int, default=None, help="truncate prompts (as bench serve)")
    p.add_argument("--max-output-tokens", type=int, default=None, help="cap outputs (as bench serve)")
    p.add_argument("--max-requests", type=int, default=None, help="replay only the first N (as bench serve)")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--cost-model", default=None, help="a `halfmoon profile` JSON (this hardware)")
    model.add_argument("--profile", choices=profile_names(),
                       help="a built-in GPU cost model (sim/profiles/README.md cites each one's sources)")
    p.add_argument("--prefill", type=int, default=served.prefill, help="prefill workers (serve's default)")
    p.add_argument("--decode", type=int, default=served.decode, help="decode workers (serve's default)")
    p.add_argument("--colocated", action="store_true", help="one co-located engine instead")
    p.add_argument("--workers", type=int, default=None, help="sweep: the worker budget to split")
    p.add_argument("--device-tokens", default=None,
                   help="KV tokens per worker's device pool (sweep: comma-separated grid); default: "
                        "serve's --kv-cache-gb in the cost model's tokens")
    p.add_argument("--host-tokens", default=None,
                   help="host DRAM tier per prefill worker, tokens (sweep: grid); default: serve's "
                        "--host-cache-gb (the node's arena) in the cost model's tokens")
    p.add_argument("--disk-tokens", type=int, default=None,
                   help="disk tier per prefill worker, tokens; default: serve's (none)")
    p.add_argument("--block-size", type=int, default=served.engine.block_size, help="the engine's KV block (tokens)")
    p.add_argument("--chunk", type=int, default=served.engine.max_num_batched_tokens,
                   help="co-located: prefill tokens per step (serve's --max-num-batched-tokens)")
    p.add_argument("--max-seqs", type=int, default=served.engine.max_num_seqs,
                   help="requests decoding at once per worker (serve's --max-num-seqs)")
    p.add_argument("--overhead-ms", type=float, default=0.0,
                   help="per-request cost outside the engines (RPCs, KV handoff, streaming); "
                        "`halfmoon bench sim-vs-live` measures it on a live server")
    p.add_argument("--tokens-per-step", type=float, default=1.0,
                   help="decode tokens per request per step: > 1 with speculative decoding (a live "
                        "worker's emitted / verifications, or bench engine --speculative); default 1")
    p.add_argument("--drain-s", type=float, default=None,
                   help="cut requests still running this long after the window (as bench serve)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", default=None, help="write the JSON and a PNG into this directory")
    p.add_argument("--no-progress", action="store_true")
    add_flags(p, ADMISSION)


def run(args: argparse.Namespace) -> int:
    from sim.workload import load

    cost = _cost_model(args)
    workload = load(args.trace, args.speed, args.window_s, args.max_input_tokens, args.max_output_tokens,
                    args.max_requests)
    base, (device, host) = sim_config(args, cost.kv_bytes_per_token)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    if args.action == "sweep":
        return _sweep(args, workload, base, cost, device, host, out)
    return _run_one(args, workload, base, cost, out)


def sim_config(args: argparse.Namespace, kv_bytes_per_token: int) -> tuple[SimConfig, Grids]:
    """The flags over serve's defaults (`serve_config`, for a model of `kv_bytes_per_token`): the
    config with each tier grid's first size, and the device and host grids (a tier flag not given:
    serve's tier alone)."""
    from cli.components import ADMISSION
    from cli.flags import build
    from sim.cluster import serve_config

    served = serve_config(kv_bytes_per_token, block_size=args.block_size)
    device = _grid(args.device_tokens, "--device-tokens") if args.device_tokens is not None else (served.device_tokens,)
    host = _grid(args.host_tokens, "--host-tokens") if args.host_tokens is not None else (served.host_tokens,)
    disk = served.disk_tokens if args.disk_tokens is None else args.disk_tokens
    base = serve_config(kv_bytes_per_token, prefill=args.prefill, decode=args.decode, colocated=args.colocated,
                        device_tokens=device[0], host_tokens=host[0], disk_tokens=disk,
                        block_size=args.block_size, chunk=args.chunk, max_seqs=args.max_seqs,
                        drain_s=args.drain_s, overhead_ms=args.overhead_ms, admission=build(ADMISSION, args),
                        tokens_per_step=args.tokens_per_step)
    return base, (device, host)


def _cost_model(args: argparse.Namespace) -> CostModel:
    from conductor.cost_model import CostModel
    from sim.builtin import load

    return CostModel.load(args.cost_model) if args.cost_model else load(args.profile)


def _grid(text: str, flag: str) -> tuple[int, ...]:
    from core.errors import ConfigError

    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{flag} takes integers (comma-separated for a sweep), got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise ConfigError(f"{flag} takes integers >= 0, got {text!r}")
    return values


def _run_one(args: argparse.Namespace, workload: Workload, base: SimConfig, cost: CostModel,
             out: Path | None) -> int:
    from tqdm import tqdm

    from sim.cluster import Simulator
    from sim.report import plot, render, summarize

    with tqdm(total=len(workload.requests), desc=f"sim {base.shape}", unit="req", file=sys.stderr,
              disable=args.no_progress) as bar:
        result = Simulator(base, cost).run(workload, tick=bar.update)
        bar.update(bar.total - bar.n)
    summary = summarize(result)
    if out is not None:
        (out / "sim.json").write_text(json.dumps(summary, indent=1) + "\n")
        summary["files"] = [str(out / "sim.json"), plot(result, out / "sim.png")]
    print(json.dumps(summary) if args.json else render(summary))
    return 0


def _sweep(args: argparse.Namespace, workload: Workload, base: SimConfig, cost: CostModel,
           device: tuple[int, ...], host: tuple[int, ...], out: Path | None) -> int:
    from tqdm import tqdm

    from core.errors import ConfigError
    from sim.sweep import Grid, plot, render, sweep

    if args.workers is None:
        raise ConfigError("halfmoon sim sweep needs --workers (the budget to split into prefill + decode)")
    grid = Grid(args.workers, device, host)
    with tqdm(total=len(grid.shapes(base)), desc="sim sweep", unit="shape", file=sys.stderr,
              disable=args.no_progress) as bar:
        result = sweep(workload, grid, base, cost, tick=lambda _row: bar.update(1))
    if out is not None:
        (out / "sweep.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "values.yaml").write_text(result["helm_values"])
        plot(result, out / "sweep.png")
    print(json.dumps(result) if args.json else render(result))
    return 0
