"""`halfmoon sim`: replay a Mooncake-format trace through a simulated cluster that runs the
Conductor's own routing and admission (sim/). `halfmoon sim sweep` tries every prefill:decode split
of a worker budget and tier size and recommends the shape, with its Helm values.

    halfmoon sim --trace T.jsonl --prefill 2 --decode 2 --profile llama3-8b-h100
    halfmoon sim sweep --trace T.jsonl --workers 8 --profile llama3-8b-h100 --out sweep/

A flag not given is what `halfmoon serve` runs with no flags (conductor/serve_defaults.py): its
shape, block, chunk, batch and admission, and its tiers in the cost model's tokens (1 GiB of
device KV and the node's 4 GiB host tier per worker, no disk tier).

Beside the replay, the offline optimum (sim/optimum.py) within two budgets: --optimum-seconds of
wall clock for the whole search (default 3) and --optimum-nodes per segment of the trace; where
either cuts it the report calls it an upper bound, says which budget cut how many segments, and
which flag to raise for the exact figure. Past a second, a progress bar on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the command's modules load when it runs, not when `halfmoon --help` is built
    from halfmoon.cli.flags import Component
    from halfmoon.conductor.cost_model import CostModel
    from halfmoon.sim.cluster import SimConfig, SimResult
    from halfmoon.sim.optimum import Optimum
    from halfmoon.sim.workload import Workload

Grids = tuple[tuple[int, ...], tuple[int, ...]]  # device, host tier sizes to sweep
DEFAULT_OPTIMUM_SECONDS = 3.0
PROGRESS_DELAY_S = 1.0  # the optimum's progress bar shows only when it runs longer


def profile_names() -> list[str]:
    from halfmoon.sim.builtin import names

    return names()


def env_dests() -> set[str]:
    from halfmoon.cli.components import ADMISSION

    return ADMISSION.dests() | sim_planner().dests()


def add_parser(p: argparse.ArgumentParser) -> None:
    from halfmoon.cli.components import ADMISSION
    from halfmoon.cli.flags import add_flags
    from halfmoon.sim.cluster import serve_shape

    served = serve_shape()  # serve_cluster() without resolving its dtype (no torch import)

    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("action", nargs="?", choices=("run", "sweep"), default="run",
                   help="run: one shape (default); sweep: every P:D split of --workers")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="Mooncake-format JSONL trace")
    source.add_argument("--synthetic", choices=("bursty",),
                        help="bursty: a generated trace of bursts arriving together (sim/bursts.py)")
    b = p.add_argument_group("synthetic bursty trace (--synthetic bursty)")
    b.add_argument("--requests", type=int, default=60, help="requests in the trace")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--burst-size", default="10,16", help="LO,HI: requests per burst (uniform)")
    b.add_argument("--burst-gap-s", default="10,20", help="LO,HI: seconds between bursts (uniform)")
    b.add_argument("--burst-input-tokens", default="64,512", help="LO,HI: prompt tokens (uniform)")
    b.add_argument("--burst-output-tokens", default="16,128", help="LO,HI: output tokens (uniform)")
    b.add_argument("--save-trace", default=None, help="write the generated trace here (replay it with --trace)")
    p.add_argument("--speed", type=float, default=1.0, help="time scale: 2 = arrivals twice as dense")
    p.add_argument("--window-s", type=float, default=None, help="replay the first seconds only")
    p.add_argument("--max-input-tokens", type=int, default=None, help="truncate prompts (as bench serve)")
    p.add_argument("--max-output-tokens", type=int, default=None, help="cap outputs (as bench serve)")
    p.add_argument("--max-requests", type=int, default=None, help="replay only the first N (as bench serve)")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--cost-model", default=None, help="a `halfmoon profile` JSON (this hardware; profiled with no flags: the "
                            "precision serve runs, --dtype auto)")
    model.add_argument("--profile", choices=profile_names(),
                       help="a built-in GPU cost model (sim/profiles/README.md cites each one's sources)")
    p.add_argument("--prefill", type=int, default=served.prefill, help="prefill workers (serve's default)")
    p.add_argument("--decode", type=int, default=served.decode, help="decode workers (serve's default)")
    p.add_argument("--colocated", action="store_true", help="one co-located engine instead")
    p.add_argument("--workers", type=int, default=None,
                   help="sweep: the device budget to split (a worker of tensor-parallel size N takes N)")
    p.add_argument("--tp-cost-model", action="append", default=[], metavar="TP=FILE",
                   help="sweep: the `halfmoon profile --tp TP` JSON of workers of that size (repeat per size); "
                        "the sweep then tries every (prefill tp, decode tp) layout over TP 1 and these")
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
                   help="prefill tokens per engine step, several prompts each (serve's --max-num-batched-tokens)")
    p.add_argument("--prefill-max-seqs", type=int, default=served.prefill_max_seqs,
                   help="prompts a prefill worker steps at once (serve's --prefill-max-seqs)")
    p.add_argument("--max-seqs", type=int, default=served.engine.max_num_seqs,
                   help="requests decoding at once per worker (serve's --max-num-seqs)")
    p.add_argument("--overhead-ms", type=float, default=None,
                   help="per-request cost outside the engines (RPCs, KV handoff, streaming); default: "
                        "the cost model's overhead_ms (what `halfmoon serve` measured at start, in the "
                        "model its dashboard serves; 0 in a profile file)")
    p.add_argument("--tokens-per-step", type=float, default=1.0,
                   help="decode tokens per request per step: > 1 with speculative decoding (a live "
                        "worker's emitted / verifications, or bench engine --speculative); default 1")
    p.add_argument("--cores", type=float, default=None,
                   help="CPU workers sharing one machine: how many step at full speed at once (its cores / "
                        "--worker-threads); more stepping stretch every step by their share. Default: "
                        "each worker its own device (GPUs)")
    p.add_argument("--max-loras", type=int, default=served.engine.max_loras,
                   help="LoRA adapter slots per prefill worker (a trace's `adapter` key; serve's default)")
    p.add_argument("--adapter-load-ms", type=float, default=None,
                   help="reading an adapter a worker does not hold (default: bench lora's SmolLM2 rank-16 figure)")
    p.add_argument("--drain-s", type=float, default=None,
                   help="cut requests still running this long after the window (as bench serve)")
    p.add_argument("--policies", default=None,
                   help="run: replay once per admission policy (comma-separated, e.g. none,predictive) and "
                        "compare them, each beside the offline optimum (default: --admission's alone)")
    p.add_argument("--optimum-nodes", type=int, default=100_000,
                   help="the offline optimum's search budget per independent segment of the trace: a "
                        "segment that needs more reports an upper bound (sim/optimum.py); 0 = no optimum")
    p.add_argument("--optimum-seconds", type=float, default=DEFAULT_OPTIMUM_SECONDS,
                   help="the offline optimum's wall-clock budget, all segments together (each gets a share "
                        "of what is left; building its inputs counts): past it a segment reports an upper "
                        "bound, and the report says how many the time budget cut; 0 = no time limit "
                        "(--optimum-nodes alone bounds it; a long trace can then take minutes)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", default=None, help="write the JSON and a PNG into this directory")
    p.add_argument("--no-progress", action="store_true")
    add_flags(p, ADMISSION)
    add_flags(p, sim_planner())


def sim_planner() -> Component:
    """The planner's flags (cli/planner_flags.py, serve's) with `off` the default: a replay with
    `--planner act` changes its split as the planner decides (sim/planned.py), `advise` records
    what it would do."""
    import dataclasses

    from halfmoon.cli.flags import Flag
    from halfmoon.cli.planner_flags import PLANNER
    from halfmoon.conductor.planner import MODES

    mode = Flag("planner", choices=MODES, default="off",
                help="off (default: the split stays); advise (the decisions it would make, printed; nothing "
                     "changes); act (the simulated workers flip, start and leave as it decides, sim/planned.py)")
    return dataclasses.replace(PLANNER, flags={**PLANNER.flags, "mode": mode})


def run(args: argparse.Namespace) -> int:
    from halfmoon.core.errors import ConfigError
    from halfmoon.sim.workload import load

    if not args.optimum_seconds >= 0:
        raise ConfigError(f"--optimum-seconds takes seconds >= 0 (0: no time limit), got {args.optimum_seconds}")
    cost = _cost_model(args)
    trace = args.trace if args.trace else _bursty_file(args)
    workload = load(trace, args.speed, args.window_s, args.max_input_tokens, args.max_output_tokens,
                    args.max_requests)
    base, (device, host) = sim_config(args, cost.kv_bytes_per_token)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    if args.action == "sweep":
        return _sweep(args, workload, base, cost, device, host, out)
    if args.planner != "off":
        return _run_planned(args, workload, base, cost, out)
    return _run_one(args, workload, base, cost, out)


def _run_planned(args: argparse.Namespace, workload: Workload, base: SimConfig, cost: CostModel,
                 out: Path | None) -> int:
    """One replay with the planner deciding every --planner-interval-s (sim/planned.py)."""
    from halfmoon.cli.flags import build
    from halfmoon.core.errors import ConfigError
    from halfmoon.sim.planned import simulate_planned
    from halfmoon.sim.planned_report import planned_summary, plot_splits, render_planned
    from halfmoon.sim.report import render, summarize

    if base.colocated or args.policies:
        raise ConfigError("--planner splits prefill and decode pools: not with --colocated or --policies")
    planned = simulate_planned(workload, base, cost, build(sim_planner(), args))
    summary = summarize(planned.result) | {"planner": planned_summary(planned)}
    if out is not None:
        (out / "sim.json").write_text(json.dumps(summary, indent=1) + "\n")
        end = max(workload.duration_s, planned.splits[-1][0])
        summary["files"] = [str(out / "sim.json"),
                            plot_splits({"planner": planned.splits}, out / "splits.png", end or 1.0)]
    print(json.dumps(summary) if args.json else render(summary) + "\n" + render_planned(planned, args.planner))
    return 0


def sim_config(args: argparse.Namespace, kv_bytes_per_token: int) -> tuple[SimConfig, Grids]:
    """The flags over serve's defaults (`serve_config`, for a model of `kv_bytes_per_token`): the
    config with each tier grid's first size, and the device and host grids (a tier flag not given:
    serve's tier alone)."""
    from halfmoon.cli.components import ADMISSION
    from halfmoon.cli.flags import build
    from halfmoon.sim.cluster import serve_config

    served = serve_config(kv_bytes_per_token, block_size=args.block_size)
    device = _grid(args.device_tokens, "--device-tokens") if args.device_tokens is not None else (served.device_tokens,)
    host = _grid(args.host_tokens, "--host-tokens") if args.host_tokens is not None else (served.host_tokens,)
    disk = served.disk_tokens if args.disk_tokens is None else args.disk_tokens
    base = serve_config(kv_bytes_per_token, prefill=args.prefill, decode=args.decode, colocated=args.colocated,
                        device_tokens=device[0], host_tokens=host[0], disk_tokens=disk,
                        block_size=args.block_size, chunk=args.chunk, max_seqs=args.max_seqs,
                        prefill_max_seqs=args.prefill_max_seqs,
                        drain_s=args.drain_s, overhead_ms=args.overhead_ms, admission=build(ADMISSION, args),
                        tokens_per_step=args.tokens_per_step, max_loras=args.max_loras, cores=args.cores,
                        **({} if args.adapter_load_ms is None else {"adapter_load_ms": args.adapter_load_ms}))
    return base, (device, host)


def _bursty_file(args: argparse.Namespace) -> Path:
    """The generated bursty trace, written to --save-trace (else a temporary file)."""
    import tempfile

    from halfmoon.core.errors import ConfigError
    from halfmoon.sim.bursts import BurstShape, bursty_trace
    from halfmoon.sim.conversations import write_trace

    try:
        shape = BurstShape(_pair(args.burst_size, int), _pair(args.burst_gap_s, float),
                           _pair(args.burst_input_tokens, int), _pair(args.burst_output_tokens, int))
        if args.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {args.requests}")
    except ValueError as e:
        raise ConfigError(f"bursty trace: {e}") from None
    name = f"bursty-{args.requests}req-seed{args.seed}.jsonl"
    path = Path(args.save_trace) if args.save_trace else Path(tempfile.mkdtemp(prefix="halfmoon-trace-")) / name
    return write_trace(bursty_trace(args.requests, args.seed, shape), path)


def _pair(text: str, kind: type) -> tuple:
    """LO,HI of a --burst-* flag (ValueError names it)."""
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"expected LO,HI, got {text!r}")
    return kind(parts[0]), kind(parts[1])


def _cost_model(args: argparse.Namespace) -> CostModel:
    from halfmoon.conductor.cost_model import CostModel
    from halfmoon.sim.builtin import load

    return CostModel.load(args.cost_model) if args.cost_model else load(args.profile)


def _tp_costs(given: list[str]) -> dict[int, CostModel]:
    """`--tp-cost-model TP=FILE` values: the profile of each tensor-parallel size."""
    from halfmoon.conductor.cost_model import CostModel
    from halfmoon.core.errors import ConfigError

    out: dict[int, CostModel] = {}
    for item in given:
        tp, sep, path = item.partition("=")
        if not sep or not tp.strip().isdigit() or int(tp) < 1 or not path:
            raise ConfigError(f"--tp-cost-model takes TP=FILE (TP >= 1), got {item!r}")
        out[int(tp)] = CostModel.load(path)
    return out


def _grid(text: str, flag: str) -> tuple[int, ...]:
    from halfmoon.core.errors import ConfigError

    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{flag} takes integers (comma-separated for a sweep), got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise ConfigError(f"{flag} takes integers >= 0, got {text!r}")
    return values


def _run_one(args: argparse.Namespace, workload: Workload, base: SimConfig, cost: CostModel,
             out: Path | None) -> int:
    from dataclasses import replace

    from halfmoon.sim.report import compare, plot, render, summarize

    policies = _policies(args.policies) if args.policies else [base.admission.admission]
    summaries, optimum = [], None
    for policy in policies:
        config = replace(base, admission=replace(base.admission, admission=policy))
        result = _replay(args, workload, config, cost)
        if optimum is None and args.optimum_nodes > 0:
            optimum = _optimum(args, result, cost)
        summary = summarize(result, optimum)
        if out is not None:
            name = "sim.json" if len(policies) == 1 else f"sim-{policy}.json"
            (out / name).write_text(json.dumps(summary, indent=1) + "\n")
            summary["files"] = [str(out / name), plot(result, out / name.replace(".json", ".png"))]
        summaries.append(summary)
    if len(summaries) == 1:
        print(json.dumps(summaries[0]) if args.json else render(summaries[0]))
    else:
        print(json.dumps({"policies": summaries}) if args.json else compare(summaries))
    return 0


def _optimum(args: argparse.Namespace, result: SimResult, cost: CostModel) -> Optimum:
    """The offline optimum of `result` within --optimum-nodes and --optimum-seconds, with a
    progress bar over its segments on stderr once it runs past PROGRESS_DELAY_S."""
    import math

    from halfmoon.sim.optimum_jobs import sim_optimum

    progress = _SegmentBar(args.no_progress)
    try:
        return sim_optimum(result, cost, args.optimum_nodes, args.optimum_seconds or math.inf, progress)
    finally:
        progress.close()


class _SegmentBar:
    """sim/optimum.py's `Progress` as a tqdm bar over the segments, on stderr (stdout carries
    the report), shown only once the search has run PROGRESS_DELAY_S (tqdm's `delay`)."""

    def __init__(self, disable: bool) -> None:
        self.disable = disable
        self.bar: Any = None

    def track(self, parts: list[list[int]]) -> Iterable[list[int]]:
        from tqdm import tqdm

        self.bar = tqdm(total=len(parts), desc="offline optimum", unit="segment", file=sys.stderr,
                        delay=PROGRESS_DELAY_S, disable=self.disable)
        for part in parts:
            yield part
            self.bar.update(1)

    def beat(self) -> None:
        if self.bar is not None:
            self.bar.update(0)  # shows the bar once past its delay, mid-segment too

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _policies(text: str) -> list[str]:
    from halfmoon.conductor.admission import Policy
    from halfmoon.core.errors import ConfigError

    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in {p.value for p in Policy}]
    if not names or unknown:
        raise ConfigError(f"--policies takes policies from {[p.value for p in Policy]}, got {text!r}")
    return names


def _replay(args: argparse.Namespace, workload: Workload, config: SimConfig, cost: CostModel) -> SimResult:
    from tqdm import tqdm

    from halfmoon.sim.cluster import Simulator

    with tqdm(total=len(workload.requests), desc=f"sim {config.shape} {config.admission.admission}", unit="req",
              file=sys.stderr, disable=args.no_progress) as bar:
        result = Simulator(config, cost).run(workload, tick=bar.update)
        bar.update(bar.total - bar.n)
    return result


def _sweep(args: argparse.Namespace, workload: Workload, base: SimConfig, cost: CostModel,
           device: tuple[int, ...], host: tuple[int, ...], out: Path | None) -> int:
    from tqdm import tqdm

    from halfmoon.core.errors import ConfigError
    from halfmoon.sim.sweep import Grid, plot, render, sweep

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
