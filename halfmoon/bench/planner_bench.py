"""`halfmoon bench serve --planner-compare`: the planner against every static split, live (issue 49).

One trace whose mix shifts (sim/phases.py: a prefill-heavy phase, a decode-heavy one, the first
again), one Ray cluster of `--nodes` raylets on this machine (bench/ray_nodes.py), and one fresh
`halfmoon serve --ray-address` per system, each replaying the same requests open loop:

    static P:D    --prefill P --decode D --planner off       for every split of --workers
    planner       --prefill P0 --decode D0 --planner act     the same workers, re-balanced at run time

Reported per system: goodput over the whole trace and per phase, failures (any non-429 status),
and for the planner its decisions (the dashboard's timeline, fetched before it stops). The ratios
printed: planner / the best static split over the whole trace, and planner / the per-phase
oracle (each phase's best static split, as if a perfect planner switched for free at the
phase's start: the bound no planner beats on this machine). Then the simulator replays the same
trace with the planner (sim/planned.py) on the live server's cost model and KV: its predicted
goodput against the live one. A timeline plot (workers per pool over time, the phases shaded,
per-phase goodput) goes to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import tempfile
import urllib.request
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from halfmoon.bench.ray_nodes import LocalRayNodes
from halfmoon.bench.report import Progress, utc_now
from halfmoon.bench.serve_bench import ReplayOptions, System, replay, serving
from halfmoon.bench.serve_metrics import RequestRecord, Slo, meets_slo, request_rows, summarize
from halfmoon.bench.sim_vs_live import worker_kv_blocks
from halfmoon.bench.workload import trace_workload
from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.planner import PlannerConfig
from halfmoon.sim.cluster import SimConfig
from halfmoon.sim.phases import Phase, boundaries, parse_phases, phased_trace

# The planner of the live run: decides every 10 s on the last 30 s, moves at the first advice
# (a phase lasts 80 s: two confirmations would spend a quarter of it), judges a move after 30 s.
PLANNER = PlannerConfig(mode="act", interval_s=10.0, window_s=30.0, confirm=1, judge_s=30.0, drain_s=3.0)


def planner_flags(config: PlannerConfig) -> str:
    """`halfmoon serve` flags of `config` (cli/planner_flags.py's names)."""
    return (f"--planner {config.mode} --planner-interval-s {config.interval_s:g} "
            f"--planner-window-s {config.window_s:g} --planner-confirm {config.confirm} "
            f"--planner-judge-s {config.judge_s:g} --planner-drain-s {config.drain_s:g} "
            f"--planner-min-gain {config.min_gain:g}")


def run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    say = Progress()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="halfmoon-planner-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    phases = parse_phases(args.phases)
    trace = out / "shifting_trace.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in phased_trace(phases, args.seed)))
    workload = trace_workload(trace, scale_tokens=512)
    slo = Slo(args.ttft_slo_ms, args.tbt_slo_ms)
    opts = ReplayOptions(slo, args.send_slo, args.warmup, args.request_timeout, not args.no_progress)
    start = tuple(int(x) for x in args.start_split.split(":"))
    systems = [(f"static {p}:{args.workers - p}", f"--prefill {p} --decode {args.workers - p} --planner off")
               for p in range(1, args.workers)]
    systems.append(("planner", f"--prefill {start[0]} --decode {start[1]} {planner_flags(PLANNER)}"))
    nodes = [{"prefill": args.workers, "decode": args.workers} for _ in range(args.nodes or 2)]
    runs = []
    with LocalRayNodes(nodes, Path(tempfile.mkdtemp(prefix="hm-ray-")), num_cpus=2) as ray_nodes:
        say(f"Ray: {len(nodes)} nodes at {ray_nodes.address}")
        for name, flags in systems:
            serve = f"{args.planner_serve_args} --ray-address {ray_nodes.address} {flags}"
            runs.append(run_one(name, serve, workload, replace(opts, label=name), out, say, phases))
    result = summary(args, argv, phases, runs)
    result["simulated"] = simulated(trace, runs[-1], phases, slo, args)
    if runs[-1]["cost_model"]:  # what `bench planner-sim --cost-model` replays this machine with
        (out / "cost_model.json").write_text(json.dumps(runs[-1]["cost_model"], indent=1) + "\n")
    (out / "planner_bench.json").write_text(json.dumps({**result, "runs": runs}, indent=1, default=str) + "\n")
    result["files"] = [str(out / "planner_bench.json"), plot(out / "planner_timeline.png", runs, phases)]
    print(json.dumps(result, default=str) if args.json else render(result))
    return 0 if all(r["metrics"]["errors"] == 0 for r in runs) else 1


def run_one(name: str, serve_args: str, workload: Any, opts: ReplayOptions, out: Path, say: Progress,
            phases: list[Phase]) -> dict[str, Any]:
    with serving(System(name.replace(" ", "-").replace(":", "-"), None, serve_args), out, say) as (target, http):
        say(f"{name}: replaying {len(workload.requests)} requests over {workload.duration_s:.0f} s")
        records, makespan = asyncio.run(replay(target, workload, opts))
        live = _get_json(f"{http}/dashboard/api/live") if http else {}
        cost = _get_json(f"{http}/dashboard/api/cost-model") if http else {}
        blocks = worker_kv_blocks(http)
    metrics = summarize(records, workload.duration_s, makespan, opts.slo)
    per_phase = phase_goodput(records, phases, opts.slo)
    say(f"{name}: goodput {metrics['goodput_rps']:.3f} req/s, per phase {per_phase}, "
        f"{metrics['errors']} errors, {metrics['rejected']} rejected")
    return {"system": name, "serve_args": serve_args, "metrics": metrics, "per_phase": per_phase,
            "planner": live.get("planner"), "cost_model": cost, "worker_kv_blocks": blocks,
            "requests": request_rows(records)}


def phase_goodput(records: Sequence[RequestRecord], phases: list[Phase], slo: Slo) -> list[float]:
    """Requests per second that met both SLOs, by the phase they arrived in."""
    return [round(sum(meets_slo(r, slo) for r in records if start <= r.arrival_s < end) / (end - start), 4)
            for _, start, end in boundaries(phases)]


def summary(args: argparse.Namespace, argv: Sequence[str] | None, phases: list[Phase],
            runs: list[dict[str, Any]]) -> dict[str, Any]:
    statics = [r for r in runs if r["system"] != "planner"]
    planner = next(r for r in runs if r["system"] == "planner")
    best = max(statics, key=lambda r: r["metrics"]["goodput_rps"])
    spans = [end - start for _, start, end in boundaries(phases)]
    oracle = sum(max(r["per_phase"][i] for r in statics) * spans[i] for i in range(len(phases))) / sum(spans)
    live = planner["metrics"]["goodput_rps"]
    return {"bench": "serve --planner-compare", "date": utc_now(), "argv": list(argv or []),
            "phases": [p.name for p in phases], "workers": args.workers,
            "goodput": {r["system"]: r["metrics"]["goodput_rps"] for r in runs},
            "per_phase": {r["system"]: r["per_phase"] for r in runs},
            "failed": {r["system"]: r["metrics"]["errors"] for r in runs},
            "best_static": best["system"], "oracle_rps": round(oracle, 4),
            "planner_vs_best_static": _ratio(live, best["metrics"]["goodput_rps"]),
            "planner_vs_oracle": _ratio(live, oracle),
            "oracle_vs_best_static": _ratio(oracle, best["metrics"]["goodput_rps"]),
            "per_phase_vs_best": [_ratio(planner["per_phase"][i], max(r["per_phase"][i] for r in statics))
                                  for i in range(len(phases))],
            "decisions": [d for d in (planner.get("planner") or {}).get("decisions", []) if d["action"] != "hold"]}


def simulated(trace: Path, planner_run: dict[str, Any], phases: list[Phase], slo: Slo,
              args: argparse.Namespace) -> dict[str, Any] | None:
    """The simulator's planner on the same trace, the live server's cost model and KV."""
    from halfmoon.sim.cluster import simulate
    from halfmoon.sim.planned import simulate_planned
    from halfmoon.sim.report import met
    from halfmoon.sim.workload import load

    if not planner_run["cost_model"]:
        return None
    cost = CostModel.from_json(json.dumps(planner_run["cost_model"]))
    start = tuple(int(x) for x in args.start_split.split(":"))
    blocks = planner_run["worker_kv_blocks"] or 0
    seqs = re.search(r"--max-num-seqs[= ](\d+)", planner_run["serve_args"])
    admission = replace(SimConfig().admission, standard_ttft_ms=slo.ttft_ms, standard_tbt_ms=slo.tbt_ms)
    threads = re.search(r"--worker-threads[= ](\d+)", planner_run["serve_args"])
    cores = len(os.sched_getaffinity(0)) / int(threads.group(1) if threads else 1)  # every raylet on this machine
    config = SimConfig(prefill=start[0], decode=start[1], device_tokens=max(blocks * 16, 16), drain_s=None,
                       admission=admission, max_seqs=int(seqs.group(1)) if seqs else SimConfig().max_seqs,
                       cores=cores if cores < args.workers else None)
    workload = load(trace)
    planned = simulate_planned(workload, config, cost, PLANNER)
    good = sum(met(r, slo.ttft_ms, slo.tbt_ms) for r in planned.result.records)
    predicted = good / planned.result.workload.duration_s
    live = planner_run["metrics"]["goodput_rps"]
    statics = {}
    for p in range(1, args.workers):
        records = simulate(workload, replace(config, prefill=p, decode=args.workers - p), cost).records
        statics[f"static {p}:{args.workers - p}"] = _sim_phases(records, phases, slo)
    return {"goodput_rps": round(predicted, 4), "live_goodput_rps": live, "cores": config.cores,
            "error_pct": None if not live else round(100.0 * (predicted - live) / live, 1),
            "moves": sum(1 for d in planned.decisions if d.action != "hold"),
            "per_phase": _sim_phases(planned.result.records, phases, slo), "statics": statics}


def _sim_phases(records: Sequence[Any], phases: list[Phase], slo: Slo) -> list[float]:
    """Simulated requests/s that met both SLOs, by the phase they arrived in."""
    from halfmoon.sim.report import met

    return [round(sum(met(r, slo.ttft_ms, slo.tbt_ms) for r in records if start <= r.arrival_s < end) / (end - start), 4)
            for _, start, end in boundaries(phases)]


def plot(path: Path, runs: list[dict[str, Any]], phases: list[Phase]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=False)
    for i, (name, start, end) in enumerate(boundaries(phases)):
        top.axvspan(start, end, color="#f3e0c0" if name == "prefill" else "#d8e8f3", alpha=0.6, lw=0)
        top.text((start + end) / 2, 0.2, name, ha="center", fontsize=8)
    planner = next(r for r in runs if r["system"] == "planner")
    decisions = (planner.get("planner") or {}).get("decisions", [])
    _split_steps(top, decisions, planner)
    top.set_ylabel("workers")
    top.set_xlabel("s since the planner's server started (decisions)")
    top.set_title("the planner's split over time")
    top.legend(fontsize=8)
    names = [r["system"] for r in runs]
    width = 0.8 / len(phases)
    for i, _ in enumerate(phases):
        bottom.bar([n + i * width for n in range(len(names))], [r["per_phase"][i] for r in runs], width,
                   label=f"phase {i + 1}: {phases[i].name}")
    bottom.set_xticks([n + width * (len(phases) - 1) / 2 for n in range(len(names))], names)
    bottom.set_ylabel("goodput, req/s")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _split_steps(ax: Any, decisions: list[dict[str, Any]], planner: dict[str, Any]) -> None:
    if not decisions:
        return
    t0 = decisions[0]["at"] - float((planner.get("planner") or {}).get("interval_s", 10.0))
    times, prefill, decode = [0.0], [], []
    first = decisions[0]["current"]
    p, d = (int(x) for x in first.rstrip("D").split("P"))
    prefill.append(p)
    decode.append(d)
    for dec in decisions:
        after = dec["next"] if dec["applied"] else dec["current"]
        p, d = (int(x) for x in after.rstrip("D").split("P"))
        times.append(dec["at"] - t0)
        prefill.append(p)
        decode.append(d)
    ax.step(times, prefill, where="post", label="prefill workers")
    ax.step(times, decode, where="post", label="decode workers")


def render(result: dict[str, Any]) -> str:
    lines = [f"planner vs static splits ({result['workers']} workers), phases {', '.join(result['phases'])}",
             f"{'system':<14}{'goodput':>9}  {'per phase (req/s)':<28}{'failed':>7}"]
    for name, good in result["goodput"].items():
        per = ", ".join(f"{x:.3f}" for x in result["per_phase"][name])
        lines.append(f"{name:<14}{good:>9.3f}  {per:<28}{result['failed'][name]:>7}")
    lines += [f"best static: {result['best_static']}; per-phase oracle {result['oracle_rps']:.3f} req/s",
              f"planner / best static: {result['planner_vs_best_static']}  (target >= 1.3)",
              f"planner / oracle: {result['planner_vs_oracle']}; per phase vs its best split: "
              f"{result['per_phase_vs_best']}  (target >= 0.9)",
              f"oracle / best static: {result['oracle_vs_best_static']} (what any planner could reach here)"]
    sim = result.get("simulated")
    if sim:
        lines.append(f"simulator's planner: {sim['goodput_rps']:.3f} req/s vs live {sim['live_goodput_rps']:.3f} "
                     f"({sim['error_pct']:+.1f}%, target within 15%), {sim['moves']} moves, cores shared: "
                     f"{sim['cores']}; per phase {sim['per_phase']}")
        for name, per in sim.get("statics", {}).items():
            lines.append(f"  simulated {name}: per phase {per}")
    for d in result["decisions"]:
        lines.append(f"  {d['action']:<8} {d['current']} -> {d['next']} applied={d['applied']}: {d['reason']}")
    return "\n".join(lines)


def _get_json(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10.0) as response:
            return json.loads(response.read().decode())
    except OSError:
        return {}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None
