"""`halfmoon bench serve --trace FILE --admission none,queue-threshold,early,predictive`:
admission control under overload (issue 18).

The trace is replayed open loop (bench/serve_bench.py's `replay`: each request at its arrival,
whatever the server does), cut to the first `--window-s` seconds of arrivals so every replay
is bounded; requests still running `--drain-s` after the window are cut off (a miss, not an
error). Per mode (`cluster`, `colocated`):

1. calibration: against `--admission none`, the largest speed factor of the trace at which
   >= `--attainment-target` % of requests meet both SLOs (double or halve from `--start-speed`,
   then bisect; at most `--probes` replays). `--base-speed X` skips it.
2. for every policy, a fresh `halfmoon serve <mode's flags> --admission POLICY
   --standard-ttft-ms T --standard-tbt-ms B` (the class SLO; requests carry none), replayed at
   each `--loads` multiple (default 1, 2, 4) of the calibrated rate, one after the other on the
   same server; after each replay the server's /metrics gives the index heartbeat's health.

Per replay: goodput, the share of admitted requests meeting both SLOs, rejections
(RESOURCE_EXHAUSTED), 5xx-equivalent errors (any other status), prefill tokens spent on
admitted requests that then missed, goodput as a share of the mode's best, and the median
relative error of the server's TTFT / TBT predictions (bench/admission_metrics.py). A verdict
per mode states the issue's targets; figures are reported, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from halfmoon.bench.admission_metrics import (POLICIES, Calibration, best_goodput, goodput, index_health, offered_rps,
                                     run_metrics, scaled, search_speed, trace_rate, verdict, windowed)
from halfmoon.bench.admission_optimum import fetch_cost_model, replay_optimum
from halfmoon.bench.admission_report import plot, render
from halfmoon.bench.report import Progress, machine_info, utc_now
from halfmoon.bench.serve_args import BASELINE_ARGS, CLUSTER_ARGS, SERVE_SLO, add_replay_flags
from halfmoon.bench.serve_bench import ReplayOptions, System, replay, serving
from halfmoon.bench.serve_metrics import RequestRecord, Slo, request_rows, summarize
from halfmoon.bench.workload import Caps, Workload, trace_workload
from halfmoon.conductor.cost_model import CostModel
from halfmoon.core.errors import ConfigError

MODES = ("cluster", "colocated")
REQUIRED_SERVE_FLAGS = ("--admission", "--standard-ttft-ms", "--standard-tbt-ms")
SCRAPE_TIMEOUT_S = 5.0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="halfmoon bench serve --admission", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--admission", required=True, help=f"policies to compare, from {','.join(POLICIES)}")
    p.add_argument("--modes", default=",".join(MODES), help="cluster and/or colocated")
    p.add_argument("--loads", default="1,2,4", help="multiples of the calibrated rate, one replay each")
    w = p.add_argument_group("workload")
    w.add_argument("--trace", required=True, help="a Mooncake trace (JSON lines) to replay")
    w.add_argument("--window-s", type=float, default=60.0, help="replay the arrivals of the first W s only")
    w.add_argument("--same-requests", action="store_true",
                   help="every load replays the requests of the 1x window, in window / load seconds "
                        "(default: each load the first --window-s of the trace at its rate)")
    w.add_argument("--drain-s", type=float, default=60.0, help="cut off requests still running this "
                   "long after the window")
    w.add_argument("--max-requests", type=int, default=None, help="use only the trace's first N requests")
    w.add_argument("--max-input-tokens", type=int, default=None, help="truncate longer prompts")
    w.add_argument("--max-output-tokens", type=int, default=None, help="cap each output")
    c = p.add_argument_group("calibration")
    c.add_argument("--base-speed", type=float, default=None, help="the 1x speed factor (skips calibration)")
    c.add_argument("--start-speed", type=float, default=0.25, help="the search's first speed factor")
    c.add_argument("--probes", type=int, default=5, help="at most this many probe replays per mode")
    c.add_argument("--attainment-target", type=float, default=90.0,
                   help="%% of requests meeting both SLOs the calibrated rate sustains")
    s = p.add_argument_group("SLOs (the server's `standard` class)")
    s.add_argument("--ttft-slo-ms", type=float, default=SERVE_SLO.standard_ttft_ms,
                   help="default: serve's standard class (conductor/serve_defaults.py)")
    s.add_argument("--tbt-slo-ms", type=float, default=SERVE_SLO.standard_tbt_ms,
                   help="default: serve's standard class (conductor/serve_defaults.py)")
    t = p.add_argument_group("servers")
    t.add_argument("--cluster-args", default=CLUSTER_ARGS, help="`halfmoon serve` flags of the cluster")
    t.add_argument("--colocated-args", default=BASELINE_ARGS, help="`halfmoon serve` flags of co-located")
    add_replay_flags(p, "admission_bench.json")
    args = p.parse_args(argv)
    args.policies = _names(p, args.admission, POLICIES, "--admission")
    args.mode_list = _names(p, args.modes, MODES, "--modes")
    args.load_list = _positive_floats(p, args.loads, "--loads")
    _check_numbers(p, args)
    return args


def _names(p: argparse.ArgumentParser, text: str, allowed: Sequence[str], flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if not names or unknown:
        p.error(f"{flag}: choose from {','.join(allowed)} (got {text!r})")
    return list(dict.fromkeys(names))


def _positive_floats(p: argparse.ArgumentParser, text: str, flag: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        p.error(f"{flag}: comma-separated numbers, got {text!r}")
    if not values or any(not v > 0 for v in values):
        p.error(f"{flag}: every value must be > 0, got {text!r}")
    return sorted(set(values))


def _check_numbers(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    positive = {"--window-s": args.window_s, "--start-speed": args.start_speed,
                "--ttft-slo-ms": args.ttft_slo_ms, "--tbt-slo-ms": args.tbt_slo_ms,
                "--request-timeout": args.request_timeout}
    if args.base_speed is not None:
        positive["--base-speed"] = args.base_speed
    for flag, value in positive.items():
        if not value > 0:
            p.error(f"{flag} must be > 0, got {value:g}")
    if args.drain_s < 0:
        p.error(f"--drain-s must be >= 0, got {args.drain_s:g}")
    if args.probes < 1:
        p.error(f"--probes must be >= 1, got {args.probes}")
    if not 0 < args.attainment_target <= 100:
        p.error(f"--attainment-target is a %, in (0, 100], got {args.attainment_target:g}")


# ---------------------------------------------------------------------------- the server


def missing_serve_flags() -> list[str]:
    """The flags this benchmark needs that `halfmoon serve --help` does not list."""
    proc = subprocess.run([sys.executable, "-m", "halfmoon.cli.main", "serve", "--help"], capture_output=True,
                          text=True, timeout=120, check=False)
    return [f for f in REQUIRED_SERVE_FLAGS if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", proc.stdout)]


def serve_args(mode_args: str, policy: str, slo: Slo) -> str:
    return (f"{mode_args} --admission {policy} --standard-ttft-ms {slo.ttft_ms:g} "
            f"--standard-tbt-ms {slo.tbt_ms:g}")


def scrape_index_health(http_url: str | None) -> dict[str, Any]:
    """The index heartbeat's health from the server's /metrics; None for what it lacks (a
    failed scrape is reported in `scrape_error`, never raised)."""
    health: dict[str, Any] = {"heartbeat_max_gap_s": None, "resyncs": None, "scrape_error": None}
    if http_url is None:
        return {**health, "scrape_error": "no HTTP URL"}
    try:
        with urllib.request.urlopen(f"{http_url.rstrip('/')}/metrics", timeout=SCRAPE_TIMEOUT_S) as response:
            return {**health, **index_health(response.read().decode())}
    except (urllib.error.URLError, OSError) as e:
        return {**health, "scrape_error": str(e)}


# ---------------------------------------------------------------------------- replays


@dataclass(frozen=True, slots=True)
class Plan:
    """What every replay shares: the trace at speed 1, the window, the SLOs, where logs go."""

    trace: Workload
    window_s: float
    drain_s: float
    opts: ReplayOptions
    log_dir: Path
    say: Progress

    same_requests: bool = False  # every load replays the 1x window's requests (see `at_load`)

    def workload(self, speed: float, window_s: float | None = None) -> Workload:
        window = self.window_s if window_s is None else window_s
        w = windowed(scaled(self.trace, speed), window)
        if not w.requests:
            raise ValueError(f"no request arrives in the first {window:g} s at speed x{speed:.3g}: "
                             "raise --window-s")
        return w

    def at_load(self, speed: float, load: float) -> Workload:
        """The replay at `load` x the 1x `speed`: the first `window_s` of it (what a longer
        trace offers at that rate), or with `same_requests` the 1x window's requests in
        `window_s / load` (a trace's later turns hit the prefix cache more than its first ones:
        windows over different spans make loads incomparable)."""
        return self.workload(speed * load, self.window_s / load if self.same_requests else None)

    def replay(self, target: str, workload: Workload, label: str) -> tuple[list[RequestRecord], float]:
        """One open-loop replay. With `same_requests` it runs under a salt of its own (`label`), so
        the prefix cache starts cold for it as for the first: a later load would otherwise find
        every prompt an earlier load computed (run 6 in docs/BENCHMARKS.md)."""
        opts = replace(self.opts, label=label, deadline_s=workload.duration_s + self.drain_s,
                       cache_salt=label if self.same_requests else None)
        self.say(f"{label}: {len(workload.requests)} requests over {workload.duration_s:.1f} s "
                 f"({offered_rps(workload) or 0:.3f} req/s)")
        return asyncio.run(replay(target, workload, opts))


def calibrate(mode: str, mode_args: str, plan: Plan, args: argparse.Namespace) -> dict[str, Any]:
    """The mode's 1x speed: given, or searched against `--admission none` (a server of its own)."""
    rate_1x = trace_rate(plan.trace)
    if args.base_speed is not None:
        return {**Calibration(args.base_speed, None, ()).to_json(rate_1x), "given": True,
                "used_speed": args.base_speed}
    system = System(f"{mode}-calibration", None, serve_args(mode_args, "none", plan.opts.slo))
    with serving(system, plan.log_dir, plan.say) as (target, _):
        def attainment(speed: float) -> float:
            w = plan.workload(speed)
            records, makespan = plan.replay(target, w, f"{mode} calibration x{speed:.3g}")
            pct = summarize(records, w.duration_s, makespan, plan.opts.slo)["slo_attainment_pct"] or 0.0
            plan.say(f"{mode} calibration x{speed:.3g}: {pct:.1f}% met both SLOs")
            return pct

        found = search_speed(attainment, args.start_speed, args.attainment_target, args.probes)
    used = found.speed if found.speed is not None else min(s for s, _ in found.probes)
    return {**found.to_json(rate_1x), "given": False, "used_speed": used}


def run_policy(mode: str, mode_args: str, policy: str, speed: float, loads: Sequence[float],
               plan: Plan) -> list[dict[str, Any]]:
    """One fresh server with `policy`, replayed at each load (its prefix cache warm across them)."""
    system = System(f"{mode}-{policy}", None, serve_args(mode_args, policy, plan.opts.slo))
    with serving(system, plan.log_dir, plan.say) as (target, http_url):
        return run_loads(Server(mode, policy, system.serve_args, target, http_url), speed, loads, plan)


@dataclass(frozen=True, slots=True)
class Server:
    """A running server under test: its mode, policy, flags and addresses."""

    mode: str
    policy: str
    serve_args: str | None
    target: str
    http_url: str | None


def run_loads(server: Server, speed: float, loads: Sequence[float], plan: Plan) -> list[dict[str, Any]]:
    """One replay per load (speed x load) against the server, each followed by a /metrics scrape
    and the offline optimum of what it replayed (bench/admission_optimum.py)."""
    runs: list[dict[str, Any]] = []
    seen: list[np.ndarray] = []  # prompts earlier replays left in the server's prefix cache
    try:
        cost: CostModel | None = fetch_cost_model(server.http_url)
        cost_error = None
    except ConfigError as e:
        cost, cost_error = None, str(e)
    for load in loads:
        w = plan.at_load(speed, load)
        label = f"{server.mode} {server.policy} {load:g}x"
        records, makespan = plan.replay(server.target, w, label)
        metrics = run_metrics(records, w.duration_s, makespan, plan.opts.slo)
        prompts = [np.asarray(r.prompt_ids) for r in w.requests]
        optimum = {"error": cost_error} if cost is None else replay_optimum(
            records, prompts, seen, cost, server.serve_args, plan.opts.slo,
            makespan if plan.same_requests else w.duration_s)
        seen.extend([] if plan.same_requests else prompts)  # salted replays start cold
        runs.append({"mode": server.mode, "policy": server.policy, "load": load, "speed": round(speed * load, 4),
                     "goodput_basis": "makespan" if plan.same_requests else "window",
                     "serve_args": server.serve_args, "workload": w.summary(), "metrics": metrics,
                     "optimum": optimum, "index": scrape_index_health(server.http_url), "requests": rows(records),
                     # the server's own (with the overhead it measured at start): `halfmoon sim --cost-model`
                     "cost_model": None if cost is None else json.loads(cost.to_json())})
        plan.say(f"{label}: goodput {goodput(runs[-1]) or 0:.3f} req/s ({runs[-1]['goodput_basis']}), "
                 f"{metrics['rejected']} rejected, {metrics['errors_5xx']} errors")
    return runs


def rows(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """serve_bench's per-request rows plus the server's predictions."""
    out = request_rows(records)
    for row, r in zip(out, records, strict=True):
        row["predicted_ttft_ms"], row["predicted_tbt_ms"] = r.prediction or (None, None)
    return out


def run_mode(mode: str, mode_args: str, plan: Plan, args: argparse.Namespace) -> dict[str, Any]:
    calibration = calibrate(mode, mode_args, plan, args)
    speed = calibration["used_speed"]
    runs = [run for policy in args.policies
            for run in run_policy(mode, mode_args, policy, speed, args.load_list, plan)]
    return {"serve_args": mode_args, "calibration": calibration, "best_goodput_rps": best_goodput(runs),
            "verdict": verdict(runs).to_json(), "runs": runs}


# ---------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    missing = missing_serve_flags()
    if missing:
        print(f"halfmoon bench serve --admission: `halfmoon serve` has no {', '.join(missing)} yet "
              "(the admission policies of issue 18)", file=sys.stderr)
        return 2
    slo = Slo(args.ttft_slo_ms, args.tbt_slo_ms)
    out = Path(args.out) if args.out else None
    log_dir = out if out is not None else Path(tempfile.mkdtemp(prefix="halfmoon-admission-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    trace = trace_workload(args.trace, 1.0, Caps(args.max_input_tokens, args.max_output_tokens), args.max_requests)
    opts = ReplayOptions(slo, send_slo=False, warmup=args.warmup, request_timeout_s=args.request_timeout,
                         progress=not args.no_progress)
    plan = Plan(trace, args.window_s, args.drain_s, opts, log_dir, Progress(), args.same_requests)
    mode_args = {"cluster": args.cluster_args, "colocated": args.colocated_args}
    modes = {mode: run_mode(mode, mode_args[mode], plan, args) for mode in args.mode_list}
    result = summary(args, argv, trace, modes)
    if out is not None:
        (out / "admission_bench.json").write_text(json.dumps({**result, "modes": modes}, indent=1) + "\n")
        result["files"] = [str(out / "admission_bench.json"), *plot(out, modes, slo.ttft_ms)]
    print(json.dumps(result) if args.json else render({**result, "modes": modes}))
    return 0


def summary(args: argparse.Namespace, argv: Sequence[str] | None, trace: Workload,
            modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The result object (runs without their per-request rows, which go to admission_bench.json)."""
    words = sys.argv[1:] if argv is None else argv
    return {"bench": "serve --admission", "date": utc_now(),
            "command": "halfmoon bench serve " + shlex.join(words), "machine": machine_info(0),
            "trace": f"{trace.name}, {len(trace.requests)} requests over {trace.duration_s:.1f} s",
            "trace_rate_rps": round(trace_rate(trace), 4), "window_s": args.window_s, "drain_s": args.drain_s,
            "loads": args.load_list, "policies": args.policies, "attainment_target_pct": args.attainment_target,
            "slo": {"ttft_ms": args.ttft_slo_ms, "tbt_ms": args.tbt_slo_ms, "sent": False},
            "modes": {mode: {**entry, "runs": [{k: v for k, v in run.items() if k != "requests"}
                                               for run in entry["runs"]]}
                      for mode, entry in modes.items()}}


if __name__ == "__main__":
    sys.exit(main())
