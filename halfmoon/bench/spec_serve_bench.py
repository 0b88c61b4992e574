"""`halfmoon bench serve --synthetic quoting --speculative-compare`: speculative decoding on the
1P1D cluster, off against `ngram`, on a workload whose answers quote their prompts.

The workload: Poisson arrivals of the prompts of bench/data/quoting_prompts.jsonl (rewrite,
extract, summarise-with-quotes), in the served model's chat template, cycled in order, each
answered greedy up to `QUOTING_MAX_TOKENS` tokens, ending at EOS (not `ignore_eos`: past its
quote a model rambles, and that ramble is not the workload). The same cluster
flags (`--cluster-args`) are started with `--speculative off` and with `--speculative ngram`, a
fresh cluster for every rate of `--rates` (the same requests at the same times): what admission
calibrates at one load (its measured / predicted errors) must not carry into the next.

    low rate (the first)    TBT p50 off / ngram        target >= 1.5  (each token sooner)
    high rate (the last)    goodput ngram / off        target >= 1.0  (never fewer served)

A verification step's n tokens reach the client in one chunk; the client spreads them over the
gap since the previous token (bench/serve_metrics.py `spread`), so TBT counts them as n gaps of
g / n, as admission's TBT prediction does. Give the high rate as twice the rate the off cluster
sustains (its SLO attainment still >= --attainment-target): `--rates` sweeps find it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from halfmoon.bench.report import Progress, machine_info, ruled, utc_now
from halfmoon.bench.serve_args import CLUSTER_ARGS
from halfmoon.bench.serve_metrics import Slo
from halfmoon.bench.workload import Caps, Workload, poisson_arrivals

DATA = Path(__file__).parent / "data"
QUOTING_FILE = DATA / "quoting_prompts.jsonl"
QUOTING_MAX_TOKENS = 128  # as bench engine --speculative; the answers end at EOS
MODES = ("off", "ngram")
TBT_TARGET, GOODPUT_TARGET = 1.5, 1.0
DEFAULT_RATES = "0.1,0.8"


def quoting_prompts(model: str) -> list[tuple[int, ...]]:
    """The quoting prompts as the served model's chat-formatted token ids."""
    from halfmoon.engine.worker import tokenizer_for_model

    tok = tokenizer_for_model(model)
    texts = [json.loads(line)["prompt"] for line in QUOTING_FILE.read_text().splitlines() if line.strip()]
    if tok.chat_template is not None:
        texts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    return [tuple(tok.encode(t)) for t in texts]


def quoting_workload(rate: float, duration_s: float, seed: int, prompts: Sequence[tuple[int, ...]],
                     caps: Caps | None = None) -> Workload:
    """Poisson arrivals at `rate` in [0, duration_s); request i asks prompt i mod len(prompts)."""
    if not prompts:
        raise ValueError(f"no quoting prompts in {QUOTING_FILE}")
    caps = caps or Caps()
    import numpy as np

    requests = tuple(replace(caps.apply(t, np.asarray(prompts[i % len(prompts)]), QUOTING_MAX_TOKENS),
                             ignore_eos=False) for i, t in enumerate(poisson_arrivals(rate, duration_s, seed)))
    return Workload(f"synthetic quoting {rate:g} req/s", requests, duration_s)


def served_model(cluster_args: str) -> str:
    """The `--model` of the cluster's flags (the serve default `smollm2` when absent)."""
    words = shlex.split(cluster_args)
    for i, word in enumerate(words):
        if word == "--model" and i + 1 < len(words):
            return words[i + 1]
        if word.startswith("--model="):
            return word.split("=", 1)[1]
    return "smollm2"


def mode_args(cluster_args: str, mode: str) -> str:
    if "--speculative" in cluster_args:
        raise ValueError("--cluster-args must not set --speculative: the bench sets it per run")
    return f"{cluster_args} --speculative {mode}"


class Gain(NamedTuple):
    """One metric, ngram against off; `gain` > 1 is better for ngram whichever way the metric runs."""

    key: str
    label: str
    unit: str
    off: float
    ngram: float
    higher_is_better: bool
    target: float | None

    @property
    def gain(self) -> float:
        return self.ngram / self.off if self.higher_is_better else self.off / self.ngram

    @property
    def met(self) -> bool | None:
        return None if self.target is None else self.gain >= self.target

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "unit": self.unit, "off": round(self.off, 3), "ngram": round(self.ngram, 3),
                "gain": round(self.gain, 4), "target": self.target, "met": self.met}


# (key, label, unit, path into the metrics, higher is better, the headline it is the target of)
GAINS = (("tbt_p50", "TBT p50", "ms", ("tbt_ms", "p50"), False, "tbt"),
         ("tpot_p50", "TPOT p50", "ms", ("tpot_ms", "p50"), False, ""),
         ("ttft_p50", "TTFT p50", "ms", ("ttft_ms", "p50"), False, ""),
         ("goodput", "goodput", "req/s", ("goodput_rps",), True, "goodput"),
         ("slo_attainment", "SLO attainment", "%", ("slo_attainment_pct",), True, ""),
         ("output_tps", "output throughput", "tok/s", ("throughput", "output_tokens_per_s"), True, ""))
TARGETS = {"tbt": TBT_TARGET, "goodput": GOODPUT_TARGET}


def _metric(metrics: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = metrics
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return None if value is None else float(value)


def gains(runs: dict[str, list[dict[str, Any]]], rate_index: int, headline: str) -> list[Gain]:
    """ngram against off at one rate; the `headline` metric ("tbt" | "goodput") carries its target
    (a metric missing on either side, or 0 where it divides, has no gain and is left out)."""
    off, on = runs["off"][rate_index]["metrics"], runs["ngram"][rate_index]["metrics"]
    out = []
    for key, label, unit, path, higher, which in GAINS:
        base, mine = _metric(off, path), _metric(on, path)
        if base is None or mine is None or (base if higher else mine) == 0:
            continue
        out.append(Gain(key, label, unit, base, mine, higher, TARGETS[which] if which == headline else None))
    return out


def render_gains(rows: list[Gain]) -> str:
    head = f"{'figure':<28}{'off':>10}{'ngram':>10}{'gain':>8}{'target':>9}  "
    lines = []
    for g in rows:
        target = f">={g.target:.2f}x" if g.target is not None else "-"
        verdict = {None: "", True: "met", False: "MISSED"}[g.met]
        lines.append(f"{g.label + ' (' + g.unit + ')':<28}{g.off:>10.1f}{g.ngram:>10.1f}{g.gain:>7.2f}x"
                     f"{target:>9}  {verdict}")
    return ruled(head, lines)


def report(args: argparse.Namespace, argv: Sequence[str], plan: list[tuple[float, Workload]],
           runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    low = gains(runs, 0, "tbt")
    high = gains(runs, len(plan) - 1, "goodput")
    tbt = next((g.gain for g in low if g.key == "tbt_p50"), None)
    goodput = next((g.gain for g in high if g.key == "goodput"), None)
    return {"bench": "serve-speculative", "date": utc_now(),
            "command": "halfmoon bench serve " + shlex.join(argv),
            "machine": machine_info(1), "cluster_args": args.cluster_args,
            "workload": f"synthetic quoting at {','.join(f'{r:g}' for r, _ in plan)} req/s for "
                        f"{args.duration:g} s (seed {args.seed}), {QUOTING_MAX_TOKENS} tokens each",
            "slo": {"ttft_ms": args.ttft_slo_ms, "tbt_ms": args.tbt_slo_ms, "sent": args.send_slo},
            "rates": [r for r, _ in plan],
            "low": {"rate": plan[0][0], "gains": {g.key: g.to_json() for g in low}},
            "high": {"rate": plan[-1][0], "gains": {g.key: g.to_json() for g in high}},
            "tbt_p50_ratio_low": tbt, "goodput_ratio_high": goodput,
            "targets_met": {"tbt_p50_low": tbt is not None and tbt >= TBT_TARGET,
                            "goodput_high": goodput is not None and goodput >= GOODPUT_TARGET},
            "runs": {m: [{k: v for k, v in r.items() if k != "requests"} for r in rs] for m, rs in runs.items()}}


def render(rep: dict[str, Any], plan: list[tuple[float, Workload]], runs: dict[str, list[dict[str, Any]]]) -> str:
    from halfmoon.bench.serve_bench import render_run

    parts = [f"halfmoon bench serve --speculative-compare: {rep['workload']}; cluster {rep['cluster_args']}; "
             f"SLO TTFT <= {rep['slo']['ttft_ms']:g} ms, TBT <= {rep['slo']['tbt_ms']:g} ms"]
    parts += [render_run(r) for mode in MODES for r in runs[mode]]
    for where, index, headline in (("low", 0, "tbt"), ("high", len(plan) - 1, "goodput")):
        parts.append(f"ngram vs off @ {plan[index][0]:g} req/s ({where} load; gain > 1: ngram better)\n"
                     + render_gains(gains(runs, index, headline)))
    met = rep["targets_met"]
    parts.append(f"headline: TBT p50 off/ngram = {_x(rep['tbt_p50_ratio_low'])} at low load (target >= "
                 f"{TBT_TARGET:g}x: {'met' if met['tbt_p50_low'] else 'MISSED'}); goodput ngram/off = "
                 f"{_x(rep['goodput_ratio_high'])} at high load (target >= {GOODPUT_TARGET:g}x: "
                 f"{'met' if met['goodput_high'] else 'MISSED'})")
    return "\n\n".join(parts)


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Both modes, every rate; the report printed (and written with --out); exit 1 on an error."""
    from halfmoon.bench.serve_bench import ReplayOptions, System, run_system

    say = Progress()
    prompts = quoting_prompts(served_model(args.cluster_args))
    rates = [float(x) for x in (args.rates or DEFAULT_RATES).split(",")]
    caps = Caps(args.max_input_tokens, args.max_output_tokens)
    plan = [(rate, quoting_workload(rate, args.duration, args.seed, prompts, caps)) for rate in rates]
    opts = ReplayOptions(Slo(args.ttft_slo_ms, args.tbt_slo_ms), args.send_slo, args.warmup,
                         args.request_timeout, not args.no_progress)
    out = Path(args.out) if args.out else None
    log_dir = out if out is not None else Path(tempfile.mkdtemp(prefix="halfmoon-spec-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    runs = {mode: [run for rate, workload in plan  # a fresh cluster per rate (module doc)
                   for run in run_system(System(f"spec-{mode}-{rate:g}", None, mode_args(args.cluster_args, mode)),
                                         [(rate, workload)], replace(opts, cache_salt=f"spec-{mode}"), log_dir, say)]
            for mode in MODES}
    for mode, rs in runs.items():
        for r in rs:
            r["system"] = mode
    rep = report(args, argv, plan, runs)
    if out is not None:
        (out / "spec_serve_bench.json").write_text(json.dumps({**rep, "requests": {
            m: [r["requests"] for r in rs] for m, rs in runs.items()}}, indent=1) + "\n")
    print(json.dumps(rep) if args.json else render(rep, plan, runs), flush=True)
    return 0 if all(r["metrics"]["errors"] == 0 and r["metrics"]["completed"] > 0
                    for rs in runs.values() for r in rs) else 1


def check_args(args: argparse.Namespace) -> str | None:
    """Why these flags don't fit the speculative comparison (None: they do)."""
    if args.synthetic != "quoting":
        return "--speculative-compare replays the quoting workload: add --synthetic quoting"
    if args.compare or args.target or args.trace:
        return "--speculative-compare starts its own 1P1D cluster twice: no --compare, --target or --trace"
    if args.cluster_args == CLUSTER_ARGS:
        return None
    try:
        mode_args(args.cluster_args, "off")
    except ValueError as e:
        return str(e)
    return None


if __name__ == "__main__":
    from halfmoon.bench.serve_args import parse_args

    sys.exit(run(parse_args(sys.argv[1:]), sys.argv[1:]))
