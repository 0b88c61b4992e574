"""`halfmoon bench sim-vs-live`: the same trace slice through the live cluster and the simulator.

For each mode (1P1D and co-located): the engine is profiled on this machine in the same run
(`halfmoon profile --quick`, the workers' thread count), a live `halfmoon serve` with that cost
model and `--admission predictive` replays the slice at the base speed (below saturation) and at
`--overload` times it, each replay from a cold prefix cache (bench serve's `--same-requests`);
then the simulator replays the same requests with the same cost model, SLOs, drain and the live
server's KV blocks. Before the replays, lone cold requests (`PROBE_PROMPTS`) go through the live
server and the simulator: the median of their TTFT differences is what a request pays outside
the engines (RPCs, the KV handoff, streaming), the simulator's `overhead_ms`. Printed: goodput,
p50 and p90 TTFT of both and the simulator's error, against issue 20's targets (goodput and
p50 TTFT within 10%, p90 TTFT within 20%).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from halfmoon.bench.admission_bench import Plan, Server, run_loads, serve_args
from halfmoon.bench.admission_metrics import trace_rate
from halfmoon.bench.report import Progress
from halfmoon.bench.serve_bench import ReplayOptions, System, serving
from halfmoon.bench.serve_metrics import Slo
from halfmoon.bench.workload import Caps, trace_workload
from halfmoon.conductor.admission import AdmissionConfig
from halfmoon.conductor.cost_model import CostModel
from halfmoon.sim.cluster import Record, SimConfig, serve_config, simulate, simulate_series
from halfmoon.sim.report import summarize
from halfmoon.sim.workload import SimRequest, Workload, load

PROBE_PROMPTS = (128, 384, 640, 128, 384, 640)  # tokens of the lone probe requests (random ids)
MODES = {"cluster": ("--prefill 1 --decode 1 --worker-threads 1", 1), "colocated": ("--colocated --threads 2", 2)}
TARGETS = {"goodput": 10.0, "ttft_p50": 10.0, "ttft_p90": 20.0}  # max |error| %


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="halfmoon bench sim-vs-live", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="a Mooncake trace (JSON lines)")
    p.add_argument("--modes", default="cluster,colocated")
    p.add_argument("--speed", type=float, default=0.15, help="the base (below saturation) speed factor")
    p.add_argument("--overload", type=float, default=2.0, help="the second replay's multiple of --speed")
    p.add_argument("--window-s", type=float, default=120.0)
    p.add_argument("--drain-s", type=float, default=30.0)
    p.add_argument("--max-input-tokens", type=int, default=768)
    p.add_argument("--max-output-tokens", type=int, default=64)
    p.add_argument("--ttft-slo-ms", type=float, default=5000.0)
    p.add_argument("--tbt-slo-ms", type=float, default=300.0)
    p.add_argument("--cost-model", action="append", default=[], metavar="MODE=FILE",
                   help="use this cost model for a mode instead of profiling (e.g. cluster=cm1.json)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None, help="write sim_vs_live.json here")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def profiled(mode: str, threads: int, given: dict[str, str], log_dir: Path, say: Progress) -> Path:
    """The mode's cost model file: given, or `halfmoon profile --quick` now."""
    if mode in given:
        return Path(given[mode])
    out = log_dir / f"cost-{mode}.json"
    say(f"{mode}: halfmoon profile --quick --threads {threads}")
    subprocess.run([sys.executable, "-m", "halfmoon.cli.main", "profile", "--quick", "--threads", str(threads),
                    "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    return out


def kv_blocks(http_url: str | None) -> int | None:
    """The live server's KV blocks (its decode worker's, or the co-located engine's)."""
    if http_url is None:
        return None
    m = re.search(r"^halfmoon_kv_cache_blocks\s+(\S+)", _metrics(http_url), re.MULTILINE)
    return int(float(m.group(1))) if m else None


def _metrics(http_url: str) -> str:
    with urllib.request.urlopen(f"{http_url.rstrip('/')}/metrics", timeout=5.0) as response:
        return response.read().decode()


def worker_kv_blocks(http_url: str | None) -> int | None:
    """The largest decode worker's device KV blocks (used + free: reserved ones are used): a
    cluster's `halfmoon_kv_cache_blocks` sums its decode workers, and a simulated worker is one
    of them (a prefill worker's pool, sized for its prefix cache, may be larger)."""
    return None if http_url is None else largest_worker_blocks(_metrics(http_url))


def largest_worker_blocks(text: str) -> int | None:
    """`worker_kv_blocks` of a /metrics text."""
    decode = {labels["worker"] for labels, _ in _series(text, "halfmoon_worker_up")
              if labels.get("role") == "decode"}
    per_worker: dict[str, float] = {}
    for labels, value in _series(text, "halfmoon_worker_kv_blocks"):
        worker = labels.get("worker")
        if worker in decode and labels.get("tier") == "device" and labels.get("state") in ("used", "free"):
            per_worker[worker] = per_worker.get(worker, 0.0) + value
    return int(max(per_worker.values())) if per_worker else None


def _series(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The labelled samples of metric `name` in a Prometheus text."""
    return [(dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))), float(m.group(2)))
            for m in re.finditer(rf'^{name}\{{([^}}]*)\}}\s+(\S+)', text, re.MULTILINE)]


@dataclass(frozen=True, slots=True)
class Live:
    """What the live server measured: its replays, its KV blocks, the lone probes' TTFTs (ms)."""

    runs: list[dict[str, Any]]
    kv_blocks: int | None
    probe_ttft_ms: list[float]


def live(mode: str, cost_file: Path, plan: Plan, args: argparse.Namespace) -> Live:
    flags = serve_args(f"{MODES[mode][0]} --cost-model {cost_file}", "predictive", plan.opts.slo)
    with serving(System(f"{mode}-live", None, flags), plan.log_dir, plan.say) as (target, http_url):
        blocks = kv_blocks(http_url)
        probes = asyncio.run(probe_live(target))
        plan.say(f"{mode}: lone probes' TTFT {', '.join(f'{t:.0f}' for t in probes)} ms")
        runs = run_loads(Server(mode, "predictive", flags, target, http_url), args.speed,
                         [1.0, args.overload], plan)
    return Live(runs, blocks, probes)


async def probe_live(target: str) -> list[float]:
    """TTFT (ms) of each `PROBE_PROMPTS` request sent alone (each prompt new: its own salt)."""
    from halfmoon.client import AsyncClient

    rng = np.random.default_rng(0x5EED)
    out = []
    async with AsyncClient(target, max_retries=0, timeout=120.0) as client:
        for i, n in enumerate(PROBE_PROMPTS):
            ids = rng.integers(100, 49152, size=n).tolist()
            start, first = time.perf_counter(), None
            async for _ in client.stream(prompt_token_ids=ids, max_tokens=2, temperature=0.0,
                                         ignore_eos=True, cache_salt=f"sim-vs-live-probe-{i}"):
                first = first or (time.perf_counter() - start) * 1e3
            assert first is not None  # to its end: the next probe finds the server idle
            out.append(first)
    return out


def lone_ttft_ms(mode: str, cost: CostModel, prompt_len: int) -> float:
    """The simulator's TTFT of one request alone in an empty cluster (no overhead)."""
    loose = AdmissionConfig(standard_ttft_ms=1e9, standard_tbt_ms=1e9)
    w = Workload((SimRequest(0, 0.0, prompt_len, 2, ()),), 1.0)
    ttft = simulate(w, SimConfig(colocated=mode == "colocated", admission=loose), cost).records[0].ttft_s
    assert ttft is not None
    return ttft * 1e3


def overhead_ms(mode: str, cost: CostModel, probes: Sequence[float]) -> float:
    """The median of live - simulated TTFT over the lone probes (>= 0)."""
    gaps = [t - lone_ttft_ms(mode, cost, n) for t, n in zip(probes, PROBE_PROMPTS, strict=True)]
    return max(0.0, float(np.median(gaps)))


def simulated(mode: str, cost_file: Path, loads: Sequence[float], blocks: int | None, overhead: float,
              args: argparse.Namespace) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """The simulator on the requests `Plan.at_load` replays (same speed, window, caps), the loads
    in turn on one simulated Conductor as on the live server: each load's summary and rows."""
    workloads = [load(args.trace, args.speed * x, args.window_s / x, args.max_input_tokens, args.max_output_tokens)
                 for x in loads]
    admission = AdmissionConfig(standard_ttft_ms=args.ttft_slo_ms, standard_tbt_ms=args.tbt_slo_ms)
    cost = CostModel.load(cost_file)
    # the live server runs serve's default tiers (its host tier too); its device pool as it reported
    config = serve_config(cost.kv_bytes_per_token, colocated=mode == "colocated", drain_s=args.drain_s,
                          admission=admission, overhead_ms=overhead,
                          **({"device_tokens": blocks * 16} if blocks else {}))
    results = simulate_series(workloads, config, cost)
    return [(summarize(r), [sim_row(rec) for rec in r.records]) for r in results]


def sim_row(r: Record) -> dict[str, Any]:
    """A simulated request in the live rows' terms (ms)."""
    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1e3, 1)

    return {"index": r.index, "arrival_s": round(r.arrival_s, 4), "prompt_tokens": r.prompt_len,
            "status": r.status, "reason": r.reason, "ttft_ms": ms(r.ttft_s), "tbt_ms": ms(r.tbt_s),
            "cached_tokens": sum(r.cached_tokens), "predicted_ttft_ms": r.predicted_ttft_ms,
            "predicted_tbt_ms": r.predicted_tbt_ms}


def compare(live_metrics: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    pairs = {"goodput": (live_metrics["goodput_rps"], sim["goodput_rps"]),
             "ttft_p50": (live_metrics["ttft_ms"]["p50"], sim["ttft_ms"]["p50"]),
             "ttft_p90": (live_metrics["ttft_ms"]["p90"], sim["ttft_ms"]["p90"])}
    out: dict[str, Any] = {}
    for name, (l, s) in pairs.items():
        err = None if not l or s is None else round(100 * (s - l) / l, 1)
        out[name] = {"live": l, "sim": s, "error_pct": err,
                     "met": err is not None and abs(err) <= TARGETS[name]}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    given = dict(item.split("=", 1) for item in args.cost_model)
    log_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="halfmoon-sim-vs-live-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    slo = Slo(args.ttft_slo_ms, args.tbt_slo_ms)
    caps = Caps(args.max_input_tokens, args.max_output_tokens)
    opts = ReplayOptions(slo, send_slo=False, warmup=2, progress=not args.no_progress)
    plan = Plan(trace_workload(args.trace, 1.0, caps), args.window_s, args.drain_s, opts, log_dir, Progress(),
                same_requests=True)
    rows = []
    for mode in args.modes.split(","):
        cost_file = profiled(mode, MODES[mode][1], given, log_dir, plan.say)
        measured = live(mode, cost_file, plan, args)
        overhead = overhead_ms(mode, CostModel.load(cost_file), measured.probe_ttft_ms)
        plan.say(f"{mode}: the simulator's overhead_ms = {overhead:.0f}")
        sims = simulated(mode, cost_file, [run["load"] for run in measured.runs], measured.kv_blocks, overhead, args)
        for run, (sim, sim_rows) in zip(measured.runs, sims, strict=True):
            rows.append({"mode": mode, "load": run["load"], "requests": run["metrics"]["requests"],
                         "kv_blocks": measured.kv_blocks, "overhead_ms": round(overhead, 1),
                         "probe_ttft_ms": [round(t, 1) for t in measured.probe_ttft_ms], **compare(run["metrics"], sim),
                         "per_request": {"live": run["requests"], "sim": sim_rows}})
        if args.out:  # each mode's rows as soon as they exist (a later mode may fail)
            (log_dir / "sim_vs_live.partial.json").write_text(json.dumps(rows) + "\n")
    result = {"trace": args.trace, "speed": args.speed, "rate_x1": trace_rate(plan.trace), "rows": rows}
    if args.out:
        (log_dir / "sim_vs_live.json").write_text(json.dumps(result, indent=1) + "\n")
        result["plot"] = plot_cdfs(log_dir / "sim_vs_live_ttft.png", rows)
    print(json.dumps(result) if args.json else render(result))
    return 0


def plot_cdfs(path: Path, rows: Sequence[dict[str, Any]]) -> str:
    """TTFT CDFs, live and simulated, one panel per mode and load (over the requests sent: a
    rejected request never gets a first token, so a curve tops out at its completed share)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 3.6), squeeze=False)
    for ax, row in zip(axes[0], rows, strict=True):
        for side, style in (("live", "-"), ("sim", "--")):
            sent = row["per_request"][side]
            values = sorted(r["ttft_ms"] for r in sent if r["status"] == "ok" and r["ttft_ms"] is not None)
            ax.step(values, np.arange(1, len(values) + 1) / max(1, len(sent)), where="post", linestyle=style,
                    label=f"{side} (p50 {row['ttft_p50'][side] or 0:.0f} ms)")
        ax.set(title=f"{row['mode']} {row['load']:g}x", xlabel="TTFT (ms)", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("fraction of requests sent")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def render(result: dict[str, Any]) -> str:
    overheads = {r["mode"]: r.get("overhead_ms") for r in result["rows"]}
    lines = [f"halfmoon bench sim-vs-live: {result['trace']} at x{result['speed']:g} (1x) and its overload",
             "overhead_ms (lone probes, live - simulated TTFT): "
             + ", ".join(f"{m} {v:g}" for m, v in overheads.items() if v is not None),
             f"{'mode':10} {'load':>5} {'req':>4} | {'goodput live/sim':>18} {'err%':>6} | "
             f"{'TTFT p50 live/sim':>19} {'err%':>6} | {'TTFT p90 live/sim':>19} {'err%':>6}"]
    for r in result["rows"]:
        cells = []
        for key, fmt in (("goodput", "{:.3f}"), ("ttft_p50", "{:.0f}"), ("ttft_p90", "{:.0f}")):
            c = r[key]
            pair = "/".join("-" if v is None else fmt.format(v) for v in (c["live"], c["sim"]))
            err = "-" if c["error_pct"] is None else f"{c['error_pct']:+.1f}"
            cells.append(f"{pair:>19} {err:>6}{'' if c['met'] else '*'}")
        lines.append(f"{r['mode']:10} {r['load']:>4g}x {r['requests']:>4} | " + " | ".join(cells))
    lines.append(f"* outside the target (goodput and TTFT p50 within {TARGETS['goodput']:g}%, "
                 f"TTFT p90 within {TARGETS['ttft_p90']:g}%)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
