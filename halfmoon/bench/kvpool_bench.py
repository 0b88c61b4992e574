"""`halfmoon bench kvpool`: the tiered KV pool's figures, each beside its baseline from this run.

    halfmoon bench kvpool [--json] [--trace FILE] [--out DIR] [--quick]
                          [--skip-bandwidth] [--skip-index] [--capacities 256,1024,4096,16384]
    python -m halfmoon.bench.kvpool_bench [same flags]

1. Tier copy bandwidth (bench.kvpool_tier_bench): HostArena put/get (device -> host, host ->
   device) vs a raw memcpy of the same bytes; DiskTier put/get (host -> disk, disk -> host) vs a
   raw file write/read. Target: >= 70% of the raw figure.
2. Index (bench.kvpool_index_bench): lookups/s of 64-block prompts against Redis holding 1M
   entries, beside a bare MGET of the same keys. Target: >= 5,000 lookups/s.
3. Hit rate replaying a Mooncake-format trace (bench.trace) through the pool's real bookkeeping,
   without KV bytes, at several capacities, beside the infinite-cache upper bound of the same
   run. Target: >= 99% of the upper bound when the tiers hold the working set.

The replay itself (3.) is bench/kvpool_replay.py.
"""


from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from halfmoon.bench.kvpool_replay import BLOCK_SIZE, BenchInputError, ReplayConfig, run_replay
from halfmoon.bench.report import Figure, Progress, machine_info, render_table, utc_now
from halfmoon.bench.trace import TraceError, TraceRequest, read_trace

# A copy of the project's shared sample trace ships with the package, so the default works anywhere.
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "sample_trace.jsonl"
DEFAULT_CAPACITIES = (256, 1024, 4096, 16384)
TARGET_BANDWIDTH_RATIO = 0.70
TARGET_LOOKUPS_PER_S = 5000.0
TARGET_HIT_RATIO = 0.99
PLOT_FILE = "kvpool_hit_rate.png"
JSON_FILE = "kvpool_bench.json"


# ---------------------------------------------------------------- bandwidth and index


def run_bandwidth(quick: bool) -> dict[str, Any]:
    """HostArena and DiskTier copy bandwidth vs raw baselines (one torch thread, as the tier
    bench does: tiers and the memcpy baseline then copy on one core alike)."""
    import torch

    from halfmoon.bench.kvpool_tier_bench import disk_bandwidth, host_bandwidth

    torch.set_num_threads(1)
    blocks, repeats = (8, 3) if quick else (64, 7)
    return {"host": host_bandwidth(blocks, repeats=repeats),
            "disk": disk_bandwidth(blocks, repeats=repeats)}


def run_index(quick: bool) -> dict[str, Any]:
    """Cluster-index lookups/s against an embedded Redis (1M entries, or 20k with --quick)."""
    from halfmoon.bench.kvpool_index_bench import bench_lookups
    from halfmoon.kvpool.redis_server import EmbeddedRedis

    entries, seconds = (20_000, 0.5) if quick else (1_000_000, 5.0)
    with EmbeddedRedis() as server:
        return bench_lookups(server.url, entries, 64, seconds)


# ---------------------------------------------------------------- report


BASELINES = {
    "host_put": "memcpy", "host_get": "memcpy", "disk_put": "raw file write",
    "disk_get": "raw file read", "index_lookups": "bare MGET", "hit_rate": "upper bound",
}


def bandwidth_figures(bw: dict[str, Any]) -> list[Figure]:
    """Each tier verb's GB/s beside the raw copy of the same bytes."""
    labels = {("host", "put"): "device->host put", ("host", "get"): "host->device get",
              ("disk", "put"): "host->disk put", ("disk", "get"): "disk->host get"}
    raw = {"put": "raw_write_gbps", "get": "raw_read_gbps"}
    return [Figure(f"{tier}_{verb}", label, "GB/s", bw[tier][f"{verb}_gbps"], bw[tier][raw[verb]],
                   True, TARGET_BANDWIDTH_RATIO) for (tier, verb), label in labels.items()]


def index_figure(index: dict[str, Any]) -> Figure:
    """Index lookups/s beside a bare MGET (its target is absolute, reported on its own line)."""
    return Figure("index_lookups", f"index, {index['threads']} callers", "lookups/s",
                  float(index["lookups_per_s"]), float(index["baseline_mget_per_s"]), True)


def hit_figures(rep: dict[str, Any]) -> list[Figure]:
    """Hit rate (% of prompt tokens) vs the upper bound, per capacity; target on the largest.
    None when the trace has no reuse at all (a ratio against 0 means nothing)."""
    runs = rep["capacities"]
    if rep["upper_bound"] == 0:
        return []
    return [Figure(f"hit_rate_{r['device_blocks']}", f"hit rate @{r['device_blocks']} blocks",
                   "%", 100 * r["hit_rate"], 100 * rep["upper_bound"], True,
                   TARGET_HIT_RATIO if r is runs[-1] else None) for r in runs]


def save_plot(rep: dict[str, Any], trace: Path, path: Path) -> None:
    """Hit rate (total and per tier, cumulative) vs device capacity, upper bound as a line."""
    from matplotlib.figure import Figure as PlotFigure  # Agg canvas; no pyplot global state

    runs = rep["capacities"]
    x = [r["device_blocks"] for r in runs]
    fig = PlotFigure(figsize=(7, 4.5), dpi=120)
    ax = fig.add_subplot()
    cum = [("device", ("device_tokens",)), ("device + host", ("device_tokens", "host_tokens")),
           ("any tier", ("device_tokens", "host_tokens", "disk_tokens"))]
    for label, keys in cum:
        ax.plot(x, [100 * sum(r[k] for k in keys) / r["prompt_tokens"] for r in runs],
                marker="o", label=f"hit rate: {label}", linewidth=2 if label == "any tier" else 1)
    ax.axhline(100 * rep["upper_bound"], color="k", linestyle="--", label="infinite-cache bound")
    ax.axhline(100 * TARGET_HIT_RATIO * rep["upper_bound"], color="grey", linestyle=":",
               label=f"target ({TARGET_HIT_RATIO:.0%} of bound)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_xlabel(f"device blocks of {BLOCK_SIZE} tokens (host {rep['host_ratio']}x, "
                  f"disk {rep['disk_ratio']}x)")
    ax.set_ylabel("% of prompt tokens served from cache")
    ax.set_title(f"KV pool hit rate: {trace.name} ({rep['requests']} requests)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def render_text(report: dict[str, Any], figs: list[Figure]) -> str:
    """The human-readable report: figures table, index target, replay table, file paths."""
    lines = [f"halfmoon bench kvpool  {report['date']}  {report['machine']['cpu']}", "",
             render_table(figs, "baseline"),
             "baselines: " + ", ".join(f"{k} vs {v}" for k, v in BASELINES.items())]
    if "index" in report:
        idx = report["index"]
        lines.append(f"index target >= {TARGET_LOOKUPS_PER_S:.0f} lookups/s over "
                     f"{idx['entries']:,} entries: {'met' if idx['met'] else 'MISSED'} "
                     f"({idx['lookups_per_s']}/s; one caller p50 {idx['p50_ms']} ms)")
    lines += ["", *replay_lines(report["replay"]), "", f"plot: {report['plot']}",
              f"json: {report['json_path']}"]
    return "\n".join(lines)


def replay_lines(rep: dict[str, Any]) -> list[str]:
    """One line per capacity: hit rate by tier, ratio to the bound, replay speed."""
    lines = [f"replay of {rep['trace']}: {rep['requests']} requests, {rep['prompt_tokens']:,} "
             f"prompt tokens, {rep['distinct_chunks']} distinct 512-token blocks",
             f"  upper bound {rep['upper_bound']:.2%} (16-token blocks); 512-token hash ids "
             f"{rep['upper_bound_512']:.2%}; hashing + bound pass {rep['upper_bound_pass_s']} s",
             f"  {'device/host/disk blocks':>26}{'hit':>9}{'device':>9}{'host':>8}{'disk':>8}"
             f"{'/bound':>8}{'req/s':>9}{'s':>8}"]
    for r in rep["capacities"]:
        share = [r[f"{t}_tokens"] / r["prompt_tokens"] for t in ("device", "host", "disk")]
        size = f"{r['device_blocks']}/{r['host_blocks']}/{r['disk_blocks']}"
        lines.append(f"  {size:>26}{r['hit_rate']:>9.2%}{share[0]:>9.2%}{share[1]:>8.2%}"
                     f"{share[2]:>8.2%}{r['hit_rate'] / rep['upper_bound']:>8.3f}"
                     f"{r['requests_per_s']:>9.0f}{r['seconds']:>8.2f}")
    lines += [f"  skipped {s['device_blocks']} device blocks: {s['reason']}"
              for s in rep["skipped"]]
    return lines


# ---------------------------------------------------------------- entry point


def _capacities(text: str) -> list[int]:
    """argparse type of --capacities: sorted distinct positive block counts."""
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated block counts, got {text!r}") from None
    if not values or values[0] <= 0:
        raise argparse.ArgumentTypeError(f"block counts must be > 0, got {text!r}")
    return values


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="halfmoon bench kvpool", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format trace")
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="where PNG + JSON go")
    p.add_argument("--quick", action="store_true", help="small bandwidth and index runs")
    p.add_argument("--skip-bandwidth", action="store_true")
    p.add_argument("--skip-index", action="store_true")
    p.add_argument("--capacities", type=_capacities, default=list(DEFAULT_CAPACITIES),
                   help="device blocks, comma-separated (default %(default)s)")
    p.add_argument("--host-ratio", type=int, default=4, help="host blocks per device block")
    p.add_argument("--disk-ratio", type=int, default=16, help="disk blocks per device block")
    p.add_argument("--running", type=int, default=0,
                   help="requests holding blocks at once (0: one at a time)")
    p.add_argument("--tpot-ms", type=float, default=50.0,
                   help="with --running: a request holds its blocks output_length x this")
    p.add_argument("--max-requests", type=int, default=0, help="replay only the first N (0: all)")
    args = p.parse_args(argv)
    if min(args.host_ratio, args.disk_ratio, args.running, args.max_requests) < 0:
        p.error("--host-ratio, --disk-ratio, --running and --max-requests must be >= 0")
    if args.tpot_ms < 0:
        p.error("--tpot-ms must be >= 0")
    return args


def load_requests(path: Path, limit: int) -> list[TraceRequest]:
    """The trace's requests (the first `limit`, if > 0); BenchInputError if there are none."""
    if not path.is_file():
        raise BenchInputError(f"trace file {path} not found (pass --trace FILE)")
    requests: list[TraceRequest] = []
    for request in read_trace(path):
        if limit and len(requests) == limit:
            break
        requests.append(request)
    if not requests:
        raise BenchInputError(f"trace file {path} holds no requests")
    return requests


def build_report(args: argparse.Namespace, command: str, progress: Progress) -> dict[str, Any]:
    """Run every selected part; the report without the figures' table."""
    requests = load_requests(args.trace, args.max_requests)
    config = ReplayConfig(args.running, args.tpot_ms, args.host_ratio, args.disk_ratio)
    report: dict[str, Any] = {"benchmark": "kvpool", "command": command, "date": utc_now(),
                              "machine": machine_info(1), "quick": args.quick}
    if not args.skip_bandwidth:
        progress("tier copy bandwidth")
        report["bandwidth"] = run_bandwidth(args.quick)
    if not args.skip_index:
        progress("cluster index lookups (loading Redis)")
        report["index"] = run_index(args.quick)
    progress(f"replaying {len(requests)} requests of {args.trace}")
    report["replay"] = {"trace": str(args.trace), **run_replay(requests, args.capacities,
                                                               config, progress)}
    largest = report["replay"]["capacities"][-1]
    report["hit_rate"], report["upper_bound"] = largest["hit_rate"], report["replay"]["upper_bound"]
    bound = report["upper_bound"]
    report["hit_rate_ratio"] = report["hit_rate"] / bound if bound else 1.0  # no reuse at all
    report["replay_requests_per_s"] = largest["requests_per_s"]
    return report


def figures_of(report: dict[str, Any]) -> list[Figure]:
    """Every figure the run measured, in report order."""
    figs = bandwidth_figures(report["bandwidth"]) if "bandwidth" in report else []
    figs += [index_figure(report["index"])] if "index" in report else []
    return figs + hit_figures(report["replay"])


def finish_report(report: dict[str, Any], figs: list[Figure], out: Path) -> None:
    """Add figures, targets and file paths; write the PNG and the JSON to `out`."""
    plot, json_path = (out / PLOT_FILE).resolve(), (out / JSON_FILE).resolve()
    save_plot(report["replay"], Path(report["replay"]["trace"]), plot)
    report["figures"] = {f.key: {**f.to_json("baseline"), "baseline_is": _baseline_of(f.key)}
                         for f in figs}
    met = [f.met for f in figs if f.met is not None]
    if "index" in report:
        met.append(bool(report["index"]["met"]))
    report["targets_met"] = all(met)
    report["plot"], report["json_path"] = str(plot), str(json_path)
    json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def _baseline_of(key: str) -> str:
    return BASELINES["hit_rate" if key.startswith("hit_rate_") else key]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table (or one JSON object). 0, or 2 on bad input."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    command = shlex.join(["halfmoon", "bench", "kvpool", *argv])
    try:
        report = build_report(args, command, Progress())
    except (BenchInputError, TraceError) as err:
        print(f"halfmoon bench kvpool: error: {err}", file=sys.stderr)
        return 2
    figs = figures_of(report)
    finish_report(report, figs, args.out)
    print(json.dumps(report, indent=2) if args.json else render_text(report, figs), flush=True)
    return 0  # targets are reported, never a pass/fail (the machine is shared and noisy)


if __name__ == "__main__":
    sys.exit(main())
