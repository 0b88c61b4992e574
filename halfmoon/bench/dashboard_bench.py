"""`halfmoon bench dashboard`: does watching the cluster slow it down, and do the dashboard's
JSON endpoints stay fast under load?

One `halfmoon serve` (1P1D by default) is replayed the same open-loop chat workload several
times, alternating **without** anything polling the dashboard (the baseline) and **with**
`--pollers` clients each fetching `/dashboard/api/live` every `--poll-s` seconds (what open
dashboard tabs do) plus the sizing options now and then. Each replay carries its own cache salt,
so no replay reuses another's prefixes. It prints, per mode, goodput, TTFT and TBT percentiles,
the ratio with/without, and the endpoints' latency (p50 / p99 / max, measured by the pollers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from halfmoon.bench.report import machine_info, utc_now
from halfmoon.bench.serve_bench import ReplayOptions, System, _threads, replay, serving
from halfmoon.bench.serve_metrics import Slo, summarize
from halfmoon.bench.workload import Caps, chat_workload

DEFAULT_SERVE_ARGS = "--prefill 1 --decode 1 --worker-threads 1 --kv-transport tcp"
ENDPOINT_P99_MS = 50.0  # the bound on the JSON endpoints under load
OPTIONS_EVERY = 10  # pollers fetch the sizing options once in this many polls


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="halfmoon bench dashboard", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals, req/s")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per replay")
    p.add_argument("--pairs", type=int, default=2, help="replays per mode (alternating without/with)")
    p.add_argument("--pollers", type=int, default=2, help="dashboard clients polling in the `with` replays")
    p.add_argument("--poll-s", type=float, default=1.0, help="each poller's interval (the page polls every 1 s)")
    p.add_argument("--max-input-tokens", type=int, default=512)
    p.add_argument("--max-output-tokens", type=int, default=64)
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--tbt-slo-ms", type=float, default=150.0)
    p.add_argument("--serve-args", default=DEFAULT_SERVE_ARGS, help="flags of the `halfmoon serve` we start")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", default=None, help="write dashboard_bench.json here")
    return p.parse_args(argv)


async def poll(http_url: str, period_s: float, stop: asyncio.Event, latencies: dict[str, list[float]]) -> None:
    """One dashboard tab: the live document every `period_s`, the sizing options now and then."""
    import httpx

    async with httpx.AsyncClient(base_url=http_url, timeout=30) as client:
        n = 0
        while not stop.is_set():
            path = "/dashboard/api/sizing/options" if n % OPTIONS_EVERY == OPTIONS_EVERY - 1 else "/dashboard/api/live"
            start = time.perf_counter()
            response = await client.get(path)
            latencies.setdefault(path, []).append((time.perf_counter() - start) * 1e3)
            response.raise_for_status()
            n += 1
            try:
                await asyncio.wait_for(stop.wait(), period_s)  # the poll interval, or the replay ended
            except TimeoutError:
                pass


async def replay_watched(target: str, http_url: str, workload: Any, opts: ReplayOptions, pollers: int,
                         period_s: float) -> tuple[list[Any], float, dict[str, list[float]]]:
    stop = asyncio.Event()
    latencies: dict[str, list[float]] = {}
    tasks = [asyncio.create_task(poll(http_url, period_s, stop, latencies)) for _ in range(pollers)]
    try:
        records, makespan = await replay(target, workload, opts)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return records, makespan, latencies


def run(args: argparse.Namespace) -> dict[str, Any]:
    slo = Slo(args.ttft_slo_ms, args.tbt_slo_ms)
    log_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="halfmoon-dashboard-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    say = (lambda _m: None) if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    runs: list[dict[str, Any]] = []
    with serving(System("halfmoon", None, args.serve_args), log_dir, say) as (target, http_url):
        assert http_url is not None
        for pair in range(args.pairs):
            caps = Caps(args.max_input_tokens, args.max_output_tokens)
            workload = chat_workload(args.rate, args.duration, seed=pair, caps=caps)
            for watched in (False, True):
                label = f"{'with' if watched else 'without'} dashboard #{pair + 1}"
                opts = ReplayOptions(slo, send_slo=False, warmup=1, progress=not args.no_progress, label=label,
                                     cache_salt=f"dashboard-bench-{pair}-{watched}")
                if watched:
                    records, makespan, latencies = asyncio.run(
                        replay_watched(target, http_url, workload, opts, args.pollers, args.poll_s))
                else:
                    (records, makespan), latencies = asyncio.run(replay(target, workload, opts)), {}
                metrics = summarize(records, workload.duration_s, makespan, slo)
                runs.append({"watched": watched, "pair": pair, "metrics": metrics,
                             "endpoints_ms": {k: _stats(v) for k, v in latencies.items()}})
                say(f"{label}: goodput {metrics['goodput_rps']} req/s, TTFT p50 {metrics['ttft_ms']['p50']} ms")
    return {"benchmark": "dashboard", "when": utc_now(), "machine": machine_info(_threads(args.serve_args)), "args": vars(args),
            "runs": runs, "summary": _summary(runs)}


def _stats(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    a = np.asarray(values)
    return {"n": len(values), "p50": round(float(np.percentile(a, 50)), 2),
            "p99": round(float(np.percentile(a, 99)), 2), "max": round(float(a.max()), 2)}


def _mode(runs: list[dict[str, Any]], watched: bool) -> dict[str, float | None]:
    chosen = [r["metrics"] for r in runs if r["watched"] == watched]

    def mean(get: Any) -> float | None:
        values = [v for m in chosen if (v := get(m)) is not None]
        return round(float(np.mean(values)), 3) if values else None

    return {"goodput_rps": mean(lambda m: m["goodput_rps"]), "ttft_p50_ms": mean(lambda m: m["ttft_ms"]["p50"]),
            "ttft_p90_ms": mean(lambda m: m["ttft_ms"]["p90"]), "tbt_p50_ms": mean(lambda m: m["tbt_ms"]["p50"]),
            "tbt_p90_ms": mean(lambda m: m["tbt_ms"]["p90"]), "completed": mean(lambda m: m["completed"])}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    without, with_ = _mode(runs, False), _mode(runs, True)
    ratio = {k: round(with_[k] / without[k], 3) if with_[k] is not None and without[k] else None for k in without}
    latencies: dict[str, list[float]] = {}
    for r in runs:  # every poll of every watched replay, pooled per endpoint
        for path, s in r["endpoints_ms"].items():
            latencies.setdefault(path, []).append(s["p99"])
    endpoints = {path: max(p99s) for path, p99s in latencies.items()}
    return {"without": without, "with": with_, "ratio_with_over_without": ratio,
            "endpoint_p99_ms_worst_replay": endpoints,
            "endpoints_met": all(v < ENDPOINT_P99_MS for v in endpoints.values()) if endpoints else None}


def render(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = ["halfmoon bench dashboard: the same open-loop load without / with dashboards polling",
             f"{'':22}{'without':>10}{'with':>10}{'with/without':>14}"]
    for key in ("goodput_rps", "completed", "ttft_p50_ms", "ttft_p90_ms", "tbt_p50_ms", "tbt_p90_ms"):
        w, x, r = s["without"][key], s["with"][key], s["ratio_with_over_without"][key]
        lines.append(f"{key:22}{_f(w):>10}{_f(x):>10}{_f(r):>14}")
    lines.append("dashboard endpoints under load (p99 of the worst replay, ms; bound "
                 f"{ENDPOINT_P99_MS:g}): " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                       s["endpoint_p99_ms_worst_replay"].items()))
    for r in result["runs"]:
        for path, st in r["endpoints_ms"].items():
            lines.append(f"  replay {r['pair'] + 1} {path}: n={st['n']} p50 {st['p50']} p99 {st['p99']} max {st['max']}")
    lines.append(f"endpoints within bound: {'MET' if s['endpoints_met'] else 'NOT MET'}")
    return "\n".join(lines)


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    if args.out:
        (Path(args.out) / "dashboard_bench.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result) if args.json else render(result))
    return 0
