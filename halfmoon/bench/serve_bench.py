"""`halfmoon bench serve`: replay a workload through the gRPC API and report SLO metrics.

Each request is sent at its arrival time (open loop: a slow server never slows the arrivals),
greedy with `ignore_eos`, so every output is exactly `max_tokens` long (the quoting workload's
answers end at EOS instead: bench/spec_serve_bench.py). Per request the client
records when each token arrived; from that (times from the request's *scheduled* arrival, so
client lag counts against the server, never hides it):

    TTFT  first token - arrival
    TBT   Mooncake's: the mean of the longest 10% of the request's token-to-token gaps
          (the longest max(1, floor(gaps / 10)) of them; fewer than 10 gaps: the longest gap)
    TPOT  (last token - first token) / (tokens - 1)
    goodput  requests that completed with TTFT <= SLO and TBT <= SLO, per second of the
             workload's window (Poisson: its duration; trace: its last arrival)

RESOURCE_EXHAUSTED (an overload or a predicted SLO miss, rejected early) is counted as a
rejection, any other status as an error; neither counts as good. `--compare` replays the same
workload against two configurations started one after the other on this machine — the
co-located baseline and the disaggregated cluster — and prints cluster / baseline ratios.
`--admission POLICIES` runs the admission-control benchmark instead (bench/admission_bench.py;
`halfmoon bench serve --admission none --help` lists its flags).

Tracing's cost: `--otlp-sink` runs an OTLP/gRPC receiver in the bench (bench/otlp_sink.py) and
points every server it starts at it (`--otlp-endpoint`); a server started with `--tracing`
exports every span there (nothing dropped, as with a collector), one without ignores it. Compare
the same cluster without and with `--tracing --trace-sampler always_on` through `--compare`'s
two slots (its tables then read co-located = tracing off, cluster = tracing on).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from halfmoon.bench.report import Figure, Progress, machine_info, render_table, ruled, utc_now
from halfmoon.bench.serve_args import parse_args, workloads
from halfmoon.bench.serve_metrics import RequestRecord, Slo, predicted_ms, request_rows, server_ms, spread, summarize
from halfmoon.bench.workload import Request, Workload

BASELINE_NAME, CLUSTER_NAME = "co-located", "cluster"
GOODPUT_TARGET = 2.0  # cluster / baseline goodput where the baseline starts missing its SLOs
WARMUP_PROMPT_TOKENS, WARMUP_MAX_TOKENS = 32, 4


# ---------------------------------------------------------------------------- replay


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    slo: Slo
    send_slo: bool = True
    warmup: int = 1
    request_timeout_s: float = 600.0
    progress: bool = True
    label: str = "replay"
    deadline_s: float | None = None  # requests still running then (replay clock) are cut off
    cache_salt: str | None = None  # every request of the replay carries it: no prefix computed by another replay hits


async def replay(target: str, workload: Workload, opts: ReplayOptions) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival time over one client; (records, makespan in s)."""
    from tqdm import tqdm

    from halfmoon.client import AsyncClient

    records = [RequestRecord(i, r.arrival_s, len(r.prompt_ids), r.max_tokens)
               for i, r in enumerate(workload.requests)]
    async with AsyncClient(target, max_retries=0, timeout=opts.request_timeout_s) as client:
        await warm_up(client, opts.warmup)
        with tqdm(total=len(records), desc=opts.label, unit="req", file=sys.stderr,
                  disable=not opts.progress, dynamic_ncols=True) as bar:
            start = time.perf_counter()
            clock = lambda: time.perf_counter() - start  # noqa: E731 - the replay's one clock
            tasks = []
            for request, record in zip(workload.requests, records, strict=True):
                delay = request.arrival_s - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                sent = send(client, request, record, clock, opts, lambda _: bar.update(1))
                tasks.append(asyncio.create_task(bounded(sent, record, clock, opts.deadline_s)))
            await asyncio.gather(*tasks)
            makespan = clock()
    return records, makespan


async def bounded(sending: Awaitable[None], record: RequestRecord, clock: Callable[[], float],
                  deadline_s: float | None) -> None:
    """`sending`, cancelled (its stream too, so the server drops the request) when the replay's
    clock passes `deadline_s`; the record's status is then "timeout": a miss, not an error."""
    if deadline_s is None:
        await sending
        return
    try:
        await asyncio.wait_for(sending, max(0.0, deadline_s - clock()))
    except TimeoutError:
        record.status, record.message = "timeout", f"still running at {deadline_s:g} s: cut off"


async def send(client: Any, request: Request, record: RequestRecord, clock: Callable[[], float],
               opts: ReplayOptions, on_done: Callable[[RequestRecord], None]) -> None:
    """One request's stream: a time stamp per token; a failure is recorded by its status."""
    import grpc

    from halfmoon.client import APIError

    slo = {"ttft_slo_ms": opts.slo.ttft_ms, "tbt_slo_ms": opts.slo.tbt_ms} if opts.send_slo else {}
    record.sent_s = clock()
    try:
        async for chunk in client.stream(prompt_token_ids=request.prompt_ids, max_tokens=request.max_tokens,
                                         temperature=0.0, ignore_eos=request.ignore_eos,
                                         cache_salt=opts.cache_salt, **slo):
            now = clock()
            record.token_times.extend(spread(record.token_times, now, len(chunk.token_ids)))
            if chunk.result is not None:
                record.cached_tokens = chunk.result.usage.cached_prompt_tokens
                record.prediction = predicted_ms(chunk.result)
                record.server = server_ms(chunk.result)
        record.status = "ok"
    except APIError as e:
        record.status = "rejected" if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED else "error"
        record.code, record.message = e.code.name, e.message
    finally:
        record.done_s = clock()
        on_done(record)


async def warm_up(client: Any, n: int) -> None:
    """A few short requests whose prompts share nothing with the workload (no cache warming);
    one that admission turns away (RESOURCE_EXHAUSTED) is no failure of the replay."""
    import grpc

    from halfmoon.client import APIError

    rng = np.random.default_rng(0xB0B)
    for _ in range(n):
        ids = rng.integers(100, 49152, size=WARMUP_PROMPT_TOKENS).tolist()
        try:
            await client.generate(prompt_token_ids=ids, max_tokens=WARMUP_MAX_TOKENS, ignore_eos=True)
        except APIError as e:
            if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise


# ---------------------------------------------------------------------------- systems


@dataclass(frozen=True, slots=True)
class System:
    """A server to replay against: an existing `target`, or `halfmoon serve <serve_args>`."""

    name: str
    target: str | None
    serve_args: str | None


@contextlib.contextmanager
def running(system: System, log_dir: Path, say: Progress) -> Iterator[str]:
    """The system's gRPC target; a server we start is stopped (SIGINT, then kill) on exit."""
    with serving(system, log_dir, say) as (target, _):
        yield target


@contextlib.contextmanager
def serving(system: System, log_dir: Path, say: Progress) -> Iterator[tuple[str, str | None]]:
    """The system's (gRPC target, HTTP URL; None for an existing target's) as in `running`."""
    if system.target is not None:
        yield system.target, None
        return
    from halfmoon.bench.api_load import start_server

    log = log_dir / f"serve-{system.name}.log"
    say(f"{system.name}: starting halfmoon serve {system.serve_args} (log {log})")
    proc, target, http_url = start_server(system.serve_args or "", log)
    say(f"{system.name}: listening on {target}")
    try:
        yield target, http_url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def systems(args: argparse.Namespace, otlp_endpoint: str | None = None) -> list[System]:
    """The servers to replay against; `otlp_endpoint` is added to the flags of those we start."""
    extra = f" --otlp-endpoint {otlp_endpoint}" if otlp_endpoint else ""
    if args.compare:
        return [System(BASELINE_NAME, None, args.baseline_args + extra),
                System(CLUSTER_NAME, None, args.cluster_args + extra)]
    if args.target:
        return [System("halfmoon", args.target, None)]
    return [System("halfmoon", None, args.serve_args + extra)]


def run_system(system: System, plan: list[tuple[float | None, Workload]], opts: ReplayOptions,
               log_dir: Path, say: Progress) -> list[dict[str, Any]]:
    """Replay every workload of the plan against one server (kept across rates: its prefix
    cache stays warm from one rate to the next)."""
    runs = []
    with running(system, log_dir, say) as target:
        for rate, workload in plan:
            label = system.name + _at(rate)
            say(f"{label}: replaying {len(workload.requests)} requests over {workload.duration_s:.1f} s")
            run_opts = replace(opts, label=label)
            records, makespan = asyncio.run(replay(target, workload, run_opts))
            metrics = summarize(records, workload.duration_s, makespan, opts.slo)
            runs.append({"system": system.name, "rate": rate, "target": target, "serve_args": system.serve_args,
                         "workload": workload.summary(), "metrics": metrics, "requests": request_rows(records)})
            say(f"{label}: {metrics['completed']}/{metrics['requests']} completed, "
                f"goodput {_fmt(metrics['goodput_rps'], 3)} req/s")
    return runs


# ---------------------------------------------------------------------------- comparison

# (key, label, unit, path into metrics, higher is better)
COMPARED = (
    ("goodput", "goodput", "req/s", ("goodput_rps",), True),
    ("slo_attainment", "SLO attainment", "%", ("slo_attainment_pct",), True),
    ("ttft_p50", "TTFT p50", "ms", ("ttft_ms", "p50"), False),
    ("ttft_p90", "TTFT p90", "ms", ("ttft_ms", "p90"), False),
    ("ttft_p99", "TTFT p99", "ms", ("ttft_ms", "p99"), False),
    ("tbt_p50", "TBT p50", "ms", ("tbt_ms", "p50"), False),
    ("tbt_p90", "TBT p90", "ms", ("tbt_ms", "p90"), False),
    ("tbt_p99", "TBT p99", "ms", ("tbt_ms", "p99"), False),
    ("tpot_mean", "TPOT mean", "ms", ("tpot_ms", "mean"), False),
    ("prefix_hit", "prefix hit rate", "%", ("prefix_hit_rate",), True),
    ("output_tps", "output throughput", "tok/s", ("throughput", "output_tokens_per_s"), True),
)


def _lookup(metrics: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = metrics
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return None if value is None else float(value) * (100.0 if path == ("prefix_hit_rate",) else 1.0)


def headline_rate(baseline_runs: list[dict[str, Any]], attainment_target: float) -> float | None:
    """The first rate where the baseline's SLO attainment drops below the target, else the
    highest rate (where it comes closest to missing)."""
    for run in baseline_runs:
        attained = run["metrics"]["slo_attainment_pct"]
        if attained is not None and attained < attainment_target:
            return run["rate"]
    return baseline_runs[-1]["rate"] if baseline_runs else None


def compare_figures(cluster: dict[str, Any], baseline: dict[str, Any],
                    headline: bool) -> tuple[list[Figure], list[str]]:
    """Figures cluster vs baseline for one rate, and the metrics left out (no ratio exists:
    a value missing, or the baseline's is 0)."""
    figures, skipped = [], []
    for key, label, unit, path, higher in COMPARED:
        c, b = _lookup(cluster["metrics"], path), _lookup(baseline["metrics"], path)
        if c is None or b is None or b == 0:
            skipped.append(f"{label}: {BASELINE_NAME} {_fmt(b, 3)}, {CLUSTER_NAME} {_fmt(c, 3)} {unit}")
            continue
        target = GOODPUT_TARGET if headline and key == "goodput" else None
        figures.append(Figure(key, label, unit, c, b, higher, target))
    return figures, skipped


@dataclass(frozen=True, slots=True)
class RateComparison:
    """Cluster vs baseline at one rate (None: a trace); `skipped` names metrics without a ratio."""

    rate: float | None
    headline: bool
    figures: list[Figure]
    skipped: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"rate": self.rate, "headline": self.headline, "skipped": self.skipped,
                "figures": {f.key: f.to_json(BASELINE_NAME) for f in self.figures}}


@dataclass(frozen=True, slots=True)
class Comparison:
    headline_rate: float | None
    attainment_target_pct: float
    per_rate: list[RateComparison]

    @property
    def headline_goodput_ratio(self) -> float | None:
        """Cluster / baseline goodput where the baseline starts missing (None: no ratio there)."""
        head = next((c for c in self.per_rate if c.headline), None)
        return next((f.ratio for f in head.figures if f.key == "goodput"), None) if head else None

    def to_json(self) -> dict[str, Any]:
        ratio = self.headline_goodput_ratio
        return {"baseline": BASELINE_NAME, "cluster": CLUSTER_NAME, "headline_rate": self.headline_rate,
                "headline_goodput_ratio": None if ratio is None else round(ratio, 4),
                "goodput_target": GOODPUT_TARGET, "attainment_target_pct": self.attainment_target_pct,
                "per_rate": [c.to_json() for c in self.per_rate]}


def comparison(runs: list[dict[str, Any]], attainment_target: float) -> Comparison:
    """Pair each baseline run with the cluster's run at the same rate."""
    base = [r for r in runs if r["system"] == BASELINE_NAME]
    clus = {r["rate"]: r for r in runs if r["system"] == CLUSTER_NAME}
    head = headline_rate(base, attainment_target)
    per_rate = []
    for b in base:
        figures, skipped = compare_figures(clus[b["rate"]], b, b["rate"] == head)
        per_rate.append(RateComparison(b["rate"], b["rate"] == head, figures, skipped))
    return Comparison(head, attainment_target, per_rate)


# ---------------------------------------------------------------------------- output


def _at(rate: float | None) -> str:
    return "" if rate is None else f" @ {rate:g} req/s"


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render_run(run: dict[str, Any]) -> str:
    m = run["metrics"]
    rate = _at(run["rate"])
    how = f"halfmoon serve {run['serve_args']}" if run["serve_args"] is not None else run["target"]
    errors = ", ".join(f"{k} x{v}" for k, v in m["errors_by_status"].items()) or "none"
    lines = [f"{run['system']}{rate}  ({how})",
             f"  requests: {m['requests']} sent, {m['completed']} completed, {m['rejected']} rejected, "
             f"{m['errors']} errors (by status: {errors})",
             f"  {'metric':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for key, label in (("ttft_ms", "TTFT (ms)"), ("tbt_ms", "TBT (ms)"), ("tpot_ms", "TPOT (ms)")):
        s = m[key]
        lines.append(f"  {label:<12}" + "".join(f"{_fmt(s[k]):>10}" for k in ("mean", "p50", "p90", "p99")))
    t = m["throughput"]
    hit = _hit_pct(m)
    lines += [f"  goodput {_fmt(m['goodput_rps'], 3)} req/s over {m['window_s']:g} s "
              f"(SLO attainment {_fmt(m['slo_attainment_pct'])}%), prefix hit rate {_fmt(hit)}%",
              f"  throughput {_fmt(t['requests_per_s'], 2)} req/s, {_fmt(t['output_tokens_per_s'])} output tok/s, "
              f"{_fmt(t['prompt_tokens_per_s'])} prompt tok/s; makespan {m['makespan_s']:.1f} s, "
              f"max send lag {_fmt(m['max_send_lag_ms'])} ms"]
    return "\n".join(lines)


def render_summary(runs: list[dict[str, Any]]) -> str:
    head = (f"{'system':<12}{'rate':>6}{'done':>6}{'rej':>5}{'err':>5}{'goodput':>9}{'attain%':>9}"
            f"{'TTFT p90':>10}{'TBT p90':>9}{'hit%':>7}")
    return ruled(head, map(_summary_row, runs))


def _summary_row(run: dict[str, Any]) -> str:
    m = run["metrics"]
    rate = "-" if run["rate"] is None else f"{run['rate']:g}"
    return (f"{run['system']:<12}{rate:>6}{m['completed']:>6}{m['rejected']:>5}{m['errors']:>5}"
            f"{_fmt(m['goodput_rps'], 3):>9}{_fmt(m['slo_attainment_pct']):>9}"
            f"{_fmt(m['ttft_ms']['p90']):>10}{_fmt(m['tbt_ms']['p90']):>9}{_fmt(_hit_pct(m)):>7}")


def _hit_pct(metrics: dict[str, Any]) -> float | None:
    rate = metrics["prefix_hit_rate"]
    return None if rate is None else 100 * rate


def render(result: dict[str, Any], runs: list[dict[str, Any]], comp: Comparison | None) -> str:
    slo = result["slo"]
    parts = [f"halfmoon bench serve: {result['workload']}; SLO TTFT <= {slo['ttft_ms']:g} ms, "
             f"TBT <= {slo['tbt_ms']:g} ms (sent to the server: {slo['sent']})",
             f"machine: {result['machine']['cpu']}, {result['machine']['cores']} cores"]
    parts += [render_run(run) for run in runs]
    if len(runs) > 1:
        parts.append(render_summary(runs))
    if comp is not None:
        for entry in comp.per_rate:
            mark = "  <- headline: the baseline starts missing here" if entry.headline else ""
            parts.append(f"{CLUSTER_NAME} (halfmoon column) vs {BASELINE_NAME}{_at(entry.rate)}{mark}\n"
                         + render_table(entry.figures, BASELINE_NAME)
                         + "".join(f"\n  no ratio: {s}" for s in entry.skipped))
        parts.append(headline_line(comp, runs))
    return "\n\n".join(parts)


def headline_line(comp: Comparison, runs: list[dict[str, Any]]) -> str:
    ratio = comp.headline_goodput_ratio
    if ratio is not None:
        value = f"{ratio:.2f}x"
    else:  # no ratio: say what each side got
        got = {r["system"]: r["metrics"]["goodput_rps"] for r in runs if r["rate"] == comp.headline_rate}
        value = (f"no ratio ({BASELINE_NAME} {_fmt(got.get(BASELINE_NAME), 3)} req/s, "
                 f"{CLUSTER_NAME} {_fmt(got.get(CLUSTER_NAME), 3)} req/s)")
    return (f"headline: goodput {CLUSTER_NAME}/{BASELINE_NAME} = {value}{_at(comp.headline_rate)} "
            f"(target >= {GOODPUT_TARGET:g}x; reported, not asserted)")


def plot(out: Path, runs: list[dict[str, Any]], slo: Slo) -> list[str]:
    """CDFs of TTFT and TBT per run, and goodput vs rate with a sweep; the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for key, title, limit in (("ttft_ms", "TTFT", slo.ttft_ms), ("tbt_ms", "TBT (mean of longest 10% gaps)",
                                                                 slo.tbt_ms)):
        fig, ax = plt.subplots(figsize=(7, 4))
        for run in runs:
            values = sorted(r[key] for r in run["requests"] if r[key] is not None and r["status"] == "ok")
            if values:
                label = run["system"] + _at(run["rate"])
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=label)
        ax.axvline(limit, color="grey", linestyle="--", label=f"SLO {limit:g} ms")
        ax.set(xlabel=f"{title} (ms)", ylabel="fraction of requests", title=f"halfmoon bench serve: {title} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        written.append(_save(fig, out / f"{key.removesuffix('_ms')}_cdf.png"))
    rates = sorted({run["rate"] for run in runs if run["rate"] is not None})
    if len(rates) > 1:
        written.append(_goodput_plot(out, runs, rates))
    return written


def _goodput_plot(out: Path, runs: list[dict[str, Any]], rates: list[float]) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in dict.fromkeys(run["system"] for run in runs):
        mine = sorted((run["rate"], run["metrics"]["goodput_rps"] or 0.0) for run in runs if run["system"] == name)
        ax.plot([r for r, _ in mine], [g for _, g in mine], marker="o", label=name)
    ax.plot(rates, rates, color="grey", linestyle="--", label="offered load")
    ax.set(xlabel="request rate (req/s)", ylabel="goodput (req/s meeting both SLOs)",
           title="halfmoon bench serve: goodput vs rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "goodput_vs_rate.png")


def _save(fig: Any, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


# ---------------------------------------------------------------------------- main


def _threads(serve_args: str | None) -> int:
    words = shlex.split(serve_args or "")
    for flag, value in zip(words, words[1:], strict=False):
        if flag in ("--threads", "--worker-threads") and value.isdigit():
            return int(value)
    return 0  # unknown: an existing server's


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if any(w == "--admission" or w.startswith("--admission=") for w in words):
        from halfmoon.bench import admission_bench

        return admission_bench.main(words)
    args = parse_args(argv)
    if args.speculative_compare:
        from halfmoon.bench import spec_serve_bench

        return spec_serve_bench.run(args, words)
    if args.defaults_compare:
        from halfmoon.bench import precision_bench

        return precision_bench.run(args, words)
    if args.planner_compare:
        from halfmoon.bench import planner_bench

        return planner_bench.run(args, argv)
    if args.nodes is not None or args.spill:
        from halfmoon.bench import prefix_bench

        return prefix_bench.run(args, argv)
    say = Progress()
    slo = Slo(args.ttft_slo_ms, args.tbt_slo_ms)
    opts = ReplayOptions(slo, args.send_slo, args.warmup, args.request_timeout, not args.no_progress)
    plan = workloads(args)
    out = Path(args.out) if args.out else None
    log_dir = out if out is not None else Path(tempfile.mkdtemp(prefix="halfmoon-serve-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(_sink()) if args.otlp_sink else None
        runs = [run for system in systems(args, sink.endpoint if sink else None)
                for run in run_system(system, plan, opts, log_dir, say)]
    comp = comparison(runs, args.attainment_target) if args.compare else None
    result = summary(args, argv, plan, runs, comp)
    if sink is not None:
        result["otlp_sink"] = {"endpoint": sink.endpoint, "spans": len(sink.spans()), "exports": sink.exports}
        say(f"OTLP sink: {result['otlp_sink']['spans']} spans received")
    if out is not None:
        (out / "serve_bench.json").write_text(json.dumps({**result, "runs": runs}, indent=1) + "\n")
        result["files"] = [str(out / "serve_bench.json"), *plot(out, runs, slo)]
    print(json.dumps(result) if args.json else render(result, runs, comp))
    return 0 if all(r["metrics"]["errors"] == 0 and r["metrics"]["completed"] > 0 for r in runs) else 1


@contextlib.contextmanager
def _sink() -> Iterator[Any]:
    from halfmoon.bench.otlp_sink import OtlpSink

    with OtlpSink() as sink:
        yield sink


def summary(args: argparse.Namespace, argv: Sequence[str] | None, plan: list[tuple[float | None, Workload]],
            runs: list[dict[str, Any]], comp: Comparison | None) -> dict[str, Any]:
    """The result object (runs without their per-request rows, which go to serve_bench.json)."""
    serve_args = args.baseline_args if args.compare else args.serve_args
    result = {"bench": "serve", "date": utc_now(),
              "command": "halfmoon bench serve " + shlex.join(sys.argv[1:] if argv is None else argv),
              "machine": machine_info(_threads(serve_args)), "workload": _workload_name(args, plan),
              "slo": {"ttft_ms": args.ttft_slo_ms, "tbt_ms": args.tbt_slo_ms, "sent": args.send_slo},
              "runs": [{k: v for k, v in run.items() if k != "requests"} for run in runs]}
    if comp is not None:
        result["comparison"] = comp.to_json()
    return result


def _workload_name(args: argparse.Namespace, plan: list[tuple[float | None, Workload]]) -> str:
    if args.trace or args.synthetic == "conversation":
        return plan[0][1].name + f", {len(plan[0][1].requests)} requests"
    rates = ",".join(f"{rate:g}" for rate, _ in plan)
    return f"synthetic {args.synthetic or 'chat'} at {rates} req/s for {args.duration:g} s (seed {args.seed})"


if __name__ == "__main__":
    sys.exit(main())
