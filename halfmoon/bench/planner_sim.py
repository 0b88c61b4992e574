"""`halfmoon bench planner-sim`: the planner at scale in the simulator (issue 49, must-hold 3).

A compressed "day" whose mix shifts three times replayed through 64 workers of the built-in
`llama3-8b-h100` profile three ways, goodput (requests/s meeting both SLOs) of each:

    static   every split of a coarse grid (prefill = 8, 16, ..., 56) over the whole day, then a
             hill-climb around the best (steps of 4 and 2 flips): the best static split
    oracle   each phase replayed alone (a fresh cluster), its best split found the same way
             (starting from the grid split that served that phase best in the whole-day
             replays, the same steps): the phases' goodputs summed over the day's length
    planner  the whole day from the best static split with `--planner act` (sim/planned.py)

and the ratios planner / best static and planner / oracle, a PNG timeline of the planner's split
with the phases shaded and the static and oracle splits drawn beside it.

The day (PHASES, rates for 64 workers): documents (prompts 24-32k, answers 10-30, 28 req/s:
prefill-bound), chat (prompts 4-8k, answers 300-600, 80 req/s: decode-bound, KV-bound at 8-10
requests a decode worker of 65,536 tokens: batch slots would not show in a 10 s window), twice each,
`--phase-s` (36) seconds a phase. The requests are long so a phase holds few of them (a 64-worker
replay costs ~2-4 ms of this CPU a request). The engines step 8192 tokens (an H100 engine's
budget; serve's CPU default of 512 would slice a 28k prompt into 56 steps). The planner ticks
every `--interval-s` (3) on the last `--window-s` (10) and moves one worker a tick (`confirm` 1:
a move is made the first tick it is advised; the default 2 would halve the moves a phase), so a
36 s phase gives it 12 ticks. Its advisor is the simulator's (`SimAdvisor`) with two economies
for this bench, so the day's 48 ticks fit in minutes on one core: at most `--advisor-requests`
(600) a replay, and instead of the planner's ~24 candidate splits only the split now and those 4
and 8 flips away are scored (`Thinned`). `--quick` shrinks everything for tests. Figures and what
they say: docs/BENCHMARKS.md.

The same comparison for another machine: `--cost-model` (a `halfmoon profile` JSON, or the
cost model a live server serves at /dashboard/api/cost-model), `--phases` (sim/phases.py's
spec), `--device-tokens`, `--chunk`, the SLOs, and `--cores` for CPU workers sharing a
machine's cores (SimConfig.cores). Run with and without `--cores`, it says how much of a
planner's possible gain (oracle / best static) the shared cores leave.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.planner import Advisor, PlannerConfig, Seen, Split
from halfmoon.sim import builtin
from halfmoon.sim.advisor import SimAdvisor
from halfmoon.sim.cluster import SimConfig, simulate
from halfmoon.sim.phases import Phase, boundaries, parse_phases, phased_trace
from halfmoon.sim.planned import PlannedSimulator
from halfmoon.sim.planned_report import goodput_between, plot_splits, render_planned
from halfmoon.sim.trace import parse_line
from halfmoon.sim.workload import Workload, build

PROFILE = "llama3-8b-h100"
DOCS = Phase("documents", 36.0, 28.0, (24000, 32000), (10, 30))
CHAT = Phase("chat", 36.0, 80.0, (4000, 8000), (300, 600))
PHASES = (DOCS, CHAT, DOCS, CHAT)
GRID = 8  # the static grid: this many splits (prefill = workers / GRID x 1..GRID-1)
STEPS = (4, 2)  # the hill-climb's steps (flips) around the grid's best
OFFSETS = (4, 8)  # at 64 workers (scaled with --workers): the splits the bench's advisor scores, flips away from the split now


class Thinned:
    """An advisor scoring a few splits of the total now instead of the planner's candidates: the
    current split (`current`: the simulated cluster's, read when scoring) and the splits
    `offsets` flips from it (the planner moves toward whichever scores best)."""

    def __init__(self, advisor: Advisor, offsets: Sequence[int] = OFFSETS) -> None:
        self.advisor, self.offsets = advisor, offsets
        self.current: Callable[[], Split] | None = None

    def score(self, window: Sequence[Seen], window_s: float, splits: Sequence[Split]) -> dict[Split, float]:
        if len(splits) <= 2:  # a move judged: the two splits it asks about
            return self.advisor.score(window, window_s, splits)
        assert self.current is not None, "Thinned.current: the simulator's split()"
        now = self.current()
        near = {now.prefill + sign * o for o in self.offsets for sign in (1, -1)} | {now.prefill}
        kept = [Split(p, now.total - p) for p in sorted(near) if 1 <= p < now.total]
        return self.advisor.score(window, window_s, kept)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="halfmoon bench planner-sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--phase-s", type=float, default=36.0, help="seconds a phase lasts")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply every phase's rate")
    p.add_argument("--interval-s", type=float, default=3.0, help="the planner's interval")
    p.add_argument("--window-s", type=float, default=10.0, help="the traffic each decision replays")
    p.add_argument("--advisor-requests", type=int, default=600, help="most requests an advisor replay holds")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cost-model", default=None, help=f"a cost model JSON (default: the built-in {PROFILE})")
    p.add_argument("--phases", default=None, help="the day's phases (sim/phases.py spec; default: the H100 day, "
                   "--phase-s and --rate-scale applied to it alone)")
    p.add_argument("--cores", type=float, default=None, help="CPU workers sharing this many cores (SimConfig.cores)")
    p.add_argument("--device-tokens", type=int, default=None, help="each worker's KV tokens (default: the simulator's)")
    p.add_argument("--chunk", type=int, default=8192, help="prefill tokens an engine step (an H100's: 8192)")
    p.add_argument("--ttft-slo-ms", type=float, default=None, help="the standard class's TTFT objective")
    p.add_argument("--tbt-slo-ms", type=float, default=None, help="the standard class's TBT objective")
    p.add_argument("--quick", action="store_true", help="8 workers, 10 s phases at 1/8 the rate (tests)")
    p.add_argument("--out", default="bench-planner-sim", help="directory for the JSON and the PNG")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.workers, args.phase_s, args.rate_scale, args.interval_s, args.window_s = 8, 12.0, 0.125, 2.0, 6.0
        args.advisor_requests = 100
    return args


def day(args: argparse.Namespace) -> tuple[list[Phase], Workload, list[Workload]]:
    """The phases, the whole day and each phase alone (arrivals from its own start)."""
    if args.phases:
        phases = parse_phases(args.phases)
    else:
        phases = [dataclasses.replace(p, duration_s=args.phase_s, rate=p.rate * args.rate_scale) for p in PHASES]
    rows = phased_trace(phases, args.seed)
    whole = _workload(rows, sum(p.duration_s for p in phases), "the day")
    alone = []
    for name, start, end in boundaries(phases):
        part = [r | {"timestamp": r["timestamp"] - int(start * 1000)} for r in rows
                if start * 1000 <= r["timestamp"] < end * 1000]
        alone.append(_workload(part, end - start, name))
    return phases, whole, alone


def _workload(rows: list[dict[str, Any]], duration_s: float, source: str) -> Workload:
    trace = [parse_line(json.dumps(r), n) for n, r in enumerate(rows, start=1)]
    return dataclasses.replace(build(trace, source=source), duration_s=duration_s)


def climb(score: Callable[[int], float], start: int, low: int, high: int, steps: Sequence[int] = (4, 2, 1)) -> int:
    """The prefill count of the best score found from `start` by trying +-step for each step
    (moving while it improves), within [low, high]."""
    best = start
    for step in steps:
        moved = True
        while moved:
            moved = False
            for p in (best - step, best + step):
                if low <= p <= high and score(p) > score(best):
                    best, moved = p, True
    return best


class Scores:
    """Goodput per prefill count of replays of one workload (each replayed once)."""

    def __init__(self, workload: Workload, base: SimConfig, cost: CostModel, workers: int) -> None:
        self.workload, self.base, self.cost, self.workers = workload, base, cost, workers
        self.results: dict[int, Any] = {}

    def result(self, prefill: int) -> Any:
        if prefill not in self.results:
            config = dataclasses.replace(self.base, prefill=prefill, decode=self.workers - prefill)
            self.results[prefill] = simulate(self.workload, config, self.cost)
        return self.results[prefill]

    def __call__(self, prefill: int) -> float:
        return goodput_between(self.result(prefill), 0.0, self.workload.duration_s)


def machine(args: argparse.Namespace) -> tuple[CostModel, SimConfig]:
    """The cost model and the cluster of the flags (module docstring)."""
    cost = CostModel.load(args.cost_model) if args.cost_model else builtin.load(PROFILE)
    admission = SimConfig().admission
    for name, value in (("standard_ttft_ms", args.ttft_slo_ms), ("standard_tbt_ms", args.tbt_slo_ms)):
        if value is not None:
            admission = dataclasses.replace(admission, **{name: value})
    extra = {} if args.device_tokens is None else {"device_tokens": args.device_tokens}
    return cost, SimConfig(prefill=args.workers // 2, decode=args.workers - args.workers // 2, chunk=args.chunk,
                           cores=args.cores, admission=admission, **extra)


def run(args: argparse.Namespace) -> dict[str, Any]:
    cost, base = machine(args)
    phases, whole, alone = day(args)
    spans = boundaries(phases)
    started = time.perf_counter()
    static = Scores(whole, base, cost, args.workers)
    stride = max(1, args.workers // GRID)  # 64 workers: 8, 16, ..., 56
    grid = list(range(stride, args.workers, stride))
    for p in grid:
        static(p)
        print(f"static {p}P{args.workers - p}D: {static(p):.3f} req/s", file=sys.stderr, flush=True)
    best = climb(static, max(grid, key=static), 1, args.workers - 1, STEPS)
    static_s = time.perf_counter() - started
    oracle = []
    for (name, start, end), part in zip(spans, alone, strict=True):
        phase_scores = Scores(part, base, cost, args.workers)
        first = max(grid, key=lambda p: goodput_between(static.result(p), start, end))
        pick = climb(phase_scores, first, 1, args.workers - 1, STEPS)
        oracle.append({"phase": name, "pick": Split(pick, args.workers - pick), "split": str(Split(pick, args.workers - pick)),
                       "goodput_rps": round(phase_scores(pick), 4), "replays": len(phase_scores.results)})
        print(f"oracle {name}: {oracle[-1]}", file=sys.stderr, flush=True)
    oracle_s = time.perf_counter() - started - static_s
    plan = PlannerConfig(mode="act", interval_s=args.interval_s, window_s=args.window_s, confirm=1,
                         judge_s=3 * args.interval_s, cooldown_s=phases[0].duration_s, drain_s=10.0)
    start_split = dataclasses.replace(base, prefill=best, decode=args.workers - best)
    advisor = SimAdvisor(start_split, cost, max_requests=args.advisor_requests)
    thinned = Thinned(advisor, tuple(max(o * args.workers // 64, 1) for o in OFFSETS))  # 64 workers: OFFSETS
    simulator = PlannedSimulator(start_split, cost, plan, thinned)
    thinned.current = simulator.split
    planned = simulator.run_planned(whole)
    planner_s = time.perf_counter() - started - static_s - oracle_s
    day_s = whole.duration_s
    good = {"static": static(best), "oracle": sum(o["goodput_rps"] * (e - s) for o, (_, s, e) in zip(oracle, spans))
            / day_s, "planner": goodput_between(planned.result, 0.0, day_s)}
    per_phase = [{"phase": n, "static": round(goodput_between(static.result(best), s, e), 4),
                  "oracle": o["goodput_rps"], "planner": round(goodput_between(planned.result, s, e), 4)}
                 for (n, s, e), o in zip(spans, oracle, strict=True)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    oracle_series = [(s, o["pick"]) for o, (_, s, _e) in zip(oracle, spans, strict=True)]
    png = plot_splits({"planner (act)": planned.splits, f"best static {Split(best, args.workers - best)}":
                       [(0.0, Split(best, args.workers - best))], "oracle per phase": oracle_series},
                      out / "planner_sim.png", day_s, spans,
                      f"{args.workers} x {Path(args.cost_model).stem if args.cost_model else PROFILE}: planner {good['planner']:.2f} req/s, best static "
                      f"{good['static']:.2f}, oracle {good['oracle']:.2f}")
    summary = {
        "workers": args.workers, "profile": args.cost_model or PROFILE, "cores": args.cores, "requests": len(whole.requests), "day_s": day_s,
        "phases": [dataclasses.asdict(p) for p in phases], "interval_s": args.interval_s, "window_s": args.window_s,
        "advisor_requests": args.advisor_requests, "advisor_replays": advisor.replays,
        "goodput_rps": {k: round(v, 4) for k, v in good.items()},
        "planner_over_static": round(good["planner"] / good["static"], 3) if good["static"] else None,
        "planner_over_oracle": round(good["planner"] / good["oracle"], 3) if good["oracle"] else None,
        "best_static": str(Split(best, args.workers - best)),
        "static_tried": {f"{p}P{args.workers - p}D": round(static(p), 4) for p in sorted(static.results)},
        "oracle": [{k: v for k, v in o.items() if k != "pick"} for o in oracle], "per_phase": per_phase,
        "planner": {"moves": len(planned.moves), "decisions": len(planned.decisions), "skipped": planned.skipped,
                    "overran": sum(m.overran for m in planned.moves), "final": str(planned.final_split)},
        "wall_s": {"static": round(static_s, 1), "oracle": round(oracle_s, 1), "planner": round(planner_s, 1)},
        "files": [png, str(out / "planner_sim.json")],
    }
    (out / "planner_sim.json").write_text(json.dumps(summary, indent=1) + "\n")
    summary["_render"] = render_planned(planned, "act", limit=12)
    return summary


def render(s: dict[str, Any]) -> str:
    g = s["goodput_rps"]
    cores = f" sharing {s['cores']:g} cores" if s.get("cores") else ""
    rows = [f"halfmoon bench planner-sim: {s['workers']} x {s['profile']}{cores}, {s['requests']} requests over "
            f"{s['day_s']:g} s ({len(s['phases'])} phases), planner every {s['interval_s']:g} s on the last "
            f"{s['window_s']:g} s (at most {s['advisor_requests']} requests a replay)",
            f"  best static {s['best_static']}: {g['static']:.3f} req/s",
            f"  oracle per phase ({', '.join(o['split'] for o in s['oracle'])}): {g['oracle']:.3f} req/s",
            f"  planner (act, from {s['best_static']}): {g['planner']:.3f} req/s -> {s['planner_over_static']}x "
            f"the best static, {s['planner_over_oracle']}x the oracle",
            "  per phase (req/s): " + "; ".join(f"{p['phase']} static {p['static']:.2f} / oracle {p['oracle']:.2f}"
                                                 f" / planner {p['planner']:.2f}" for p in s["per_phase"]),
            f"  wall: static {s['wall_s']['static']} s, oracle {s['wall_s']['oracle']} s, planner "
            f"{s['wall_s']['planner']} s ({s['advisor_replays']} advisor replays)",
            s["_render"], "  files: " + ", ".join(s["files"])]
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    summary = run(parse_args(argv))
    text = render(summary)
    summary.pop("_render")
    print(json.dumps(summary) if "--json" in (argv or []) else text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
