"""`halfmoon sim`: replay a Mooncake-format trace through a simulated cluster that runs the
Conductor's own routing and admission (sim/). `halfmoon sim sweep` tries every prefill:decode split
of a worker budget and tier size and recommends the shape, with its Helm values.

    halfmoon sim --trace T.jsonl --prefill 2 --decode 2 --profile llama3-8b-h100
    halfmoon sim sweep --trace T.jsonl --workers 8 --profile llama3-8b-h100 --out sweep/
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


def profile_names() -> list[str]:
    from sim.builtin import names

    return names()


def env_dests() -> set[str]:
    from cli.components import ADMISSION

    return ADMISSION.dests()


def add_parser(p: argparse.ArgumentParser) -> None:
    from cli.components import ADMISSION
    from cli.flags import add_flags

    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("action", nargs="?", choices=("run", "sweep"), default="run",
                   help="run: one shape (default); sweep: every P:D split of --workers")
    p.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    p.add_argument("--speed", type=float, default=1.0, help="time scale: 2 = arrivals twice as dense")
    p.add_argument("--window-s", type=float, default=None, help="replay the first seconds only")
    p.add_argument("--max-input-tokens", type=int, default=None, help="truncate prompts (as bench serve)")
    p.add_argument("--max-output-tokens", type=int, default=None, help="cap outputs (as bench serve)")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--cost-model", default=None, help="a `halfmoon profile` JSON (this hardware)")
    model.add_argument("--profile", choices=profile_names(),
                       help="a built-in GPU cost model (sim/profiles/README.md cites each one's sources)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--colocated", action="store_true", help="one co-located engine instead")
    p.add_argument("--workers", type=int, default=None,
                   help="sweep: the device budget to split (a worker of tensor-parallel size N takes N)")
    p.add_argument("--tp-cost-model", action="append", default=[], metavar="TP=FILE",
                   help="sweep: the `halfmoon profile --tp TP` JSON of workers of that size (repeat per size); "
                        "the sweep then tries every (prefill tp, decode tp) layout over TP 1 and these")
    p.add_argument("--device-tokens", default="65536",
                   help="KV tokens per worker's device pool (sweep: comma-separated grid)")
    p.add_argument("--host-tokens", default="0", help="host DRAM tier per worker, tokens (sweep: grid)")
    p.add_argument("--disk-tokens", type=int, default=0, help="disk tier per worker, tokens")
    p.add_argument("--block-size", type=int, default=16, help="the engine's KV block (tokens)")
    p.add_argument("--chunk", type=int, default=512, help="co-located: prefill tokens per step")
    p.add_argument("--max-seqs", type=int, default=64, help="requests decoding at once per worker")
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
    from cli.components import ADMISSION
    from cli.flags import build
    from sim.cluster import SimConfig
    from sim.workload import load

    cost = _cost_model(args)
    workload = load(args.trace, args.speed, args.window_s, args.max_input_tokens, args.max_output_tokens)
    device, host = _grid(args.device_tokens, "--device-tokens"), _grid(args.host_tokens, "--host-tokens")
    base = SimConfig(args.prefill, args.decode, args.colocated, device[0], host[0], args.disk_tokens,
                     args.block_size, args.chunk, args.max_seqs, drain_s=args.drain_s, overhead_ms=args.overhead_ms,
                     admission=build(ADMISSION, args), tokens_per_step=args.tokens_per_step)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    if args.action == "sweep":
        return _sweep(args, workload, base, cost, device, host, out)
    return _run_one(args, workload, base, cost, out)


def _cost_model(args: argparse.Namespace) -> CostModel:
    from conductor.cost_model import CostModel
    from sim.builtin import load

    return CostModel.load(args.cost_model) if args.cost_model else load(args.profile)


def _tp_costs(given: list[str]) -> dict[int, CostModel]:
    """`--tp-cost-model TP=FILE` values: the profile of each tensor-parallel size."""
    from conductor.cost_model import CostModel
    from core.errors import ConfigError

    out: dict[int, CostModel] = {}
    for item in given:
        tp, sep, path = item.partition("=")
        if not sep or not tp.strip().isdigit() or int(tp) < 1 or not path:
            raise ConfigError(f"--tp-cost-model takes TP=FILE (TP >= 1), got {item!r}")
        out[int(tp)] = CostModel.load(path)
    return out


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
    tp_costs = _tp_costs(args.tp_cost_model)
    sizes = sorted({1, *tp_costs})
    grid = Grid(args.workers, device, host, tuple((p, d) for p in sizes for d in sizes))
    with tqdm(total=len(grid.shapes(base)), desc="sim sweep", unit="shape", file=sys.stderr,
              disable=args.no_progress) as bar:
        result = sweep(workload, grid, base, cost, tick=lambda _row: bar.update(1), tp_costs=tp_costs)
    if out is not None:
        (out / "sweep.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "values.yaml").write_text(result["helm_values"])
        plot(result, out / "sweep.png")
    print(json.dumps(result) if args.json else render(result))
    return 0
