"""`halfmoon bench serve --defaults-compare`: goodput of the 1P1D cluster in each precision the
engine offers, on the same replay, against the precision `serve` runs by default.

The same cluster flags (`--cluster-args`, 1P1D) are started once per precision of `PRECISIONS`
(fp32, bf16, bf16 + int8, bf16 + int4 weight-only, fp32 + int4) and replay the same open-loop Poisson
arrivals of the synthetic chat workload at every rate of `--rates` (one cluster per precision,
kept across its rates, each rate's requests salted so no rate hits another's prefixes). The
precision `serve` picks with no flag (conductor/serve_defaults.py: `--dtype auto`, resolved on this
machine, bf16 or fp32) is the row every ratio is taken against; it is one of `PRECISIONS`, so it
runs once, with its flags spelled out. `--precisions fp32,bf16` runs a subset (with bf16 and the
default always).

    every rate    goodput default / bfloat16                target >= 1.0  (issue 38: defaults that serve)
    every rate    goodput default / the best other precision   reported (> 1: the default is the best)

While the default is bf16 the first ratio compares a run with itself (1.00x by construction);
the second is the one that chose it, and would show a precision that overtakes it.

The quality side of the choice (perplexity and teacher-forced agreement against fp32 within the
quantization bounds) is asserted by tests/engine/test_serve_precision.py, not measured here.
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from halfmoon.bench.report import Progress, machine_info, ruled, utc_now
from halfmoon.bench.serve_metrics import Slo
from halfmoon.bench.workload import Caps, chat_workload

GOODPUT_TARGET = 1.0  # the default's goodput against bf16's, at every rate
DEFAULT_RATES = "1.5,3"


class Precision(NamedTuple):
    dtype: str
    quantization: str

    @property
    def name(self) -> str:
        short = {"float32": "fp32", "bfloat16": "bf16"}[self.dtype]
        return short if self.quantization == "none" else f"{short}+{self.quantization}"

    def flags(self) -> str:
        return f"--dtype {self.dtype} --quantization {self.quantization}"


PRECISIONS = (Precision("float32", "none"), Precision("bfloat16", "none"), Precision("bfloat16", "int8"),
              Precision("bfloat16", "int4"), Precision("float32", "int4"))
BF16 = Precision("bfloat16", "none")
BY_NAME = {p.name: p for p in PRECISIONS}


def chosen(names: str | None) -> tuple[Precision, ...]:
    """`--precisions fp32,bf16` (default: all of `PRECISIONS`), always with bf16 and serve's
    default, which the headline compares; ValueError names an unknown one."""
    picked = [BY_NAME[n] for n in names.split(",") if n in BY_NAME] if names else list(PRECISIONS)
    unknown = [n for n in (names or "").split(",") if n and n not in BY_NAME]
    if unknown:
        raise ValueError(f"--precisions: unknown {', '.join(unknown)}; choose from {', '.join(BY_NAME)}")
    return tuple(p for p in PRECISIONS if p in {*picked, BF16, serve_default()})


def serve_default() -> Precision:
    """The precision `halfmoon serve` runs with no --dtype / --quantization (on a CPU)."""
    from halfmoon.conductor.serve_defaults import serve_engine

    engine = serve_engine()
    return Precision(engine.dtype, engine.quantization)


def precision_args(cluster_args: str, precision: Precision) -> str:
    words = shlex.split(cluster_args)
    if any(w.split("=", 1)[0] in ("--dtype", "--quantization") for w in words):
        raise ValueError("--cluster-args must not set --dtype or --quantization: the bench sets them per run")
    return f"{cluster_args} {precision.flags()}"


def goodput(runs: dict[str, list[dict[str, Any]]], name: str, index: int) -> float:
    return float(runs[name][index]["metrics"]["goodput_rps"] or 0.0)


def ratio(mine: float, base: float) -> float | None:
    return None if base == 0 else mine / base


def report(args: argparse.Namespace, argv: Sequence[str], rates: list[float],
           runs: dict[str, list[dict[str, Any]]], default: Precision) -> dict[str, Any]:
    precisions = [BY_NAME[name] for name in runs]
    per_rate = []
    for i, rate in enumerate(rates):
        base = goodput(runs, default.name, i)
        rows = {p.name: {"goodput_rps": goodput(runs, p.name, i), "vs_default": ratio(goodput(runs, p.name, i), base)}
                for p in precisions}
        vs_bf16 = ratio(base, goodput(runs, BF16.name, i))
        others = [(goodput(runs, p.name, i), p.name) for p in precisions if p != default]
        best = max(others, default=None)
        per_rate.append({"rate": rate, "precisions": rows, "default_vs_bf16": vs_bf16,
                         "best_other": None if best is None else best[1],
                         "default_vs_best_other": None if best is None else ratio(base, best[0]),
                         "met": base >= GOODPUT_TARGET * goodput(runs, BF16.name, i)})
    return {"bench": "serve-defaults", "date": utc_now(), "command": "halfmoon bench serve " + shlex.join(argv),
            "machine": {**machine_info(1), "isa": isa()}, "cluster_args": args.cluster_args, "default": default.name,
            "workload": f"synthetic chat at {','.join(f'{r:g}' for r in rates)} req/s for {args.duration:g} s "
                        f"(seed {args.seed})",
            "slo": {"ttft_ms": args.ttft_slo_ms, "tbt_ms": args.tbt_slo_ms, "sent": args.send_slo},
            "per_rate": per_rate, "target_met": all(r["met"] for r in per_rate),
            "runs": {name: [{k: v for k, v in r.items() if k != "requests"} for r in rs] for name, rs in runs.items()}}


def render_table(rep: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> str:
    head = (f"{'precision':<12}{'rate':>6}{'done':>6}{'rej':>5}{'goodput':>9}{'attain%':>9}{'TTFT p90':>10}"
            f"{'TBT p90':>9}{'out tok/s':>11}{'vs default':>12}")
    lines = []
    for p in (BY_NAME[name] for name in runs):
        for i, entry in enumerate(rep["per_rate"]):
            m = runs[p.name][i]["metrics"]
            vs = entry["precisions"][p.name]["vs_default"]
            mark = " (default)" if p.name == rep["default"] else ""
            lines.append(f"{p.name + mark:<12}{entry['rate']:>6g}{m['completed']:>6}{m['rejected']:>5}"
                         f"{m['goodput_rps'] or 0:>9.3f}{_f(m['slo_attainment_pct']):>9}{_f(m['ttft_ms']['p90']):>10}"
                         f"{_f(m['tbt_ms']['p90']):>9}{_f(m['throughput']['output_tokens_per_s']):>11}"
                         f"{'-' if vs is None else f'{vs:.2f}x':>12}")
    return ruled(head, lines)


def render(rep: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> str:
    from halfmoon.bench.serve_bench import render_run

    parts = [f"halfmoon bench serve --defaults-compare: {rep['workload']}; cluster {rep['cluster_args']}; "
             f"SLO TTFT <= {rep['slo']['ttft_ms']:g} ms, TBT <= {rep['slo']['tbt_ms']:g} ms; serve's default "
             f"precision: {rep['default']}; machine: {rep['machine']['cpu']}, {rep['machine']['isa']}"]
    parts += [render_run(r) for rs in runs.values() for r in rs]
    parts.append(render_table(rep, runs))
    heads = [f"{e['rate']:g} req/s {_x(e['default_vs_bf16'])}" for e in rep["per_rate"]]
    best = [f"{e['rate']:g} req/s {_x(e['default_vs_best_other'])} ({e['best_other']})" for e in rep["per_rate"]]
    parts.append(f"headline: goodput {rep['default']} (default) / bf16 = {', '.join(heads)} (target >= "
                 f"{GOODPUT_TARGET:g}x at every rate: {'met' if rep['target_met'] else 'MISSED'})\n"
                 f"          goodput {rep['default']} (default) / the best other precision = {', '.join(best)}")
    return "\n\n".join(parts)


def isa() -> str:
    """What the bf16 choice depends on: torch's CPU kernels' ISA, oneDNN's bf16 path, and the
    variables that cap them (ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY emulate an AVX2-only CPU)."""
    import os

    import torch

    capped = [f"{k}={os.environ[k]}" for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY") if k in os.environ]
    return (f"torch {torch.backends.cpu.get_cpu_capability()}, oneDNN bf16 "
            f"{'yes' if torch.ops.mkldnn._is_mkldnn_bf16_supported() else 'no'}"
            + (f" ({', '.join(capped)})" if capped else ""))


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Every precision, every rate; the report printed (and written with --out); exit 1 on an error."""
    from halfmoon.bench.serve_bench import ReplayOptions, System

    say = Progress()
    rates = [float(x) for x in (args.rates or DEFAULT_RATES).split(",")]
    opts = ReplayOptions(Slo(args.ttft_slo_ms, args.tbt_slo_ms), args.send_slo, args.warmup,
                         args.request_timeout, not args.no_progress)
    out = Path(args.out) if args.out else None
    log_dir = out if out is not None else Path(tempfile.mkdtemp(prefix="halfmoon-defaults-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    default = serve_default()
    runs: dict[str, list[dict[str, Any]]] = {}
    for p in chosen(args.precisions):
        system = System(p.name, None, precision_args(args.cluster_args, p))
        runs[p.name] = replay_rates(system, rates, args, opts, log_dir, say)
    rep = report(args, argv, rates, runs, default)
    if out is not None:
        (out / "defaults_bench.json").write_text(json.dumps({**rep, "requests": {
            n: [r["requests"] for r in rs] for n, rs in runs.items()}}, indent=1) + "\n")
    print(json.dumps(rep) if args.json else render(rep, runs), flush=True)
    return 0 if all(r["metrics"]["errors"] == 0 and r["metrics"]["completed"] > 0
                    for rs in runs.values() for r in rs) else 1


def replay_rates(system: Any, rates: list[float], args: argparse.Namespace, opts: Any, log_dir: Path,
                 say: Progress) -> list[dict[str, Any]]:
    """Every rate's chat replay against one started cluster, each rate's requests under their own
    cache salt (the rates' workloads share their prompts: request i is the same at every rate)."""
    import asyncio

    from halfmoon.bench.serve_bench import replay, request_rows, running, summarize

    caps, runs = Caps(args.max_input_tokens, args.max_output_tokens), []
    with running(system, log_dir, say) as target:
        for i, rate in enumerate(rates):
            workload = chat_workload(rate, args.duration, args.seed, caps)
            label = f"{system.name} @ {rate:g} req/s"
            say(f"{label}: replaying {len(workload.requests)} requests over {workload.duration_s:.1f} s")
            records, makespan = asyncio.run(replay(target, workload,
                                                   replace(opts, label=label, cache_salt=f"{system.name}-{i}")))
            metrics = summarize(records, workload.duration_s, makespan, opts.slo)
            runs.append({"system": system.name, "rate": rate, "target": target, "serve_args": system.serve_args,
                         "workload": workload.summary(), "metrics": metrics, "requests": request_rows(records)})
            say(f"{label}: {metrics['completed']}/{metrics['requests']} completed, "
                f"goodput {metrics['goodput_rps'] or 0:.3f} req/s")
    return runs


def check_args(args: argparse.Namespace) -> str | None:
    """Why these flags don't fit the defaults comparison (None: they do)."""
    if args.synthetic not in (None, "chat") or args.trace:
        return "--defaults-compare replays the synthetic chat workload: no --trace or other --synthetic"
    if args.compare or args.target or args.speculative_compare:
        return "--defaults-compare starts its own 1P1D cluster per precision: no --compare, --target, --speculative-compare"
    try:
        precision_args(args.cluster_args, PRECISIONS[0])
        chosen(args.precisions)
    except ValueError as e:
        return str(e)
    return None
