"""What a simulated replay measured, in the live benchmark's terms (bench/serve_metrics.py):
goodput = requests that met both SLOs per second of the replayed window; TTFT from arrival to
the first token; TBT = the mean of a request's longest tenth of token gaps (Mooncake's). Hit
rates are prompt tokens served by each tier over the prompt tokens of the admitted requests;
utilisation is a worker's busy time over the makespan."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from halfmoon.sim.cluster import Record, SimConfig, SimResult
from halfmoon.sim.optimum import Optimum
from halfmoon.sim.optimum_jobs import optimum_cell, optimum_summary, outcome


def objectives(result: SimResult) -> tuple[float, float]:
    """The default class's TTFT / TBT objectives in ms (inf = none)."""
    return config_objectives(result.config)


def config_objectives(config: SimConfig) -> tuple[float, float]:
    """`objectives` of a replay of `config` (before it has run)."""
    cfg = config.admission
    cls = cfg.classes()[cfg.default_class]
    return (cls.ttft_ms or math.inf, cls.tbt_ms or math.inf)


def met(r: Record, ttft_ms: float, tbt_ms: float) -> bool:
    return (r.status == "ok" and r.ttft_s is not None and r.ttft_s * 1e3 <= ttft_ms
            and (r.tbt_s is None or r.tbt_s * 1e3 <= tbt_ms))


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 90, 99)) -> dict[str, float | None]:
    """Percentiles in ms of values in s, linearly interpolated as bench/serve_metrics.py's (None
    when there are none)."""
    if not values:
        return {f"p{q}": None for q in qs}
    ms = np.asarray(values, dtype=np.float64) * 1e3
    return {f"p{q}": round(float(np.percentile(ms, q)), 1) for q in qs}


def summarize(result: SimResult, optimum: Optimum | None = None) -> dict[str, Any]:
    """The replay's figures; with `optimum` (sim/optimum_jobs.py's `sim_optimum` of it) also the
    policy's goodput as a % of the offline optimum and the requests where they differ."""
    ttft_slo, tbt_slo = objectives(result)
    records = result.records
    ok = [r for r in records if r.status == "ok"]
    good = sum(met(r, ttft_slo, tbt_slo) for r in records)
    admitted = [r for r in records if r.status != "rejected"]
    window = result.workload.duration_s or result.makespan_s
    prompt = sum(r.prompt_len for r in admitted)
    tiers = [sum(r.cached_tokens[i] for r in admitted) for i in range(3)]
    span = result.makespan_s or 1.0
    busy = {wid: round(s / span, 3) for wid, s in result.busy_s.items()}
    summary = {
        "shape": result.config.shape, "workers": result.config.workers, "devices": result.config.devices,
        "policy": result.config.admission.admission,
        "requests": len(records), "admitted": len(admitted), "completed": len(ok),
        "rejected": dict(Counter(r.reason or "" for r in records if r.status == "rejected")),
        "errors": sum(r.status == "error" for r in records), "timed_out": sum(r.status == "timeout" for r in records),
        "slo": {"ttft_ms": ttft_slo, "tbt_ms": tbt_slo}, "slo_met": good,
        "goodput_rps": round(good / window, 4) if window > 0 else None,
        "goodput_per_worker": round(good / window / result.config.workers, 4) if window > 0 else None,
        "goodput_per_device": round(good / window / result.config.devices, 4) if window > 0 else None,
        "admitted_ok_pct": round(100 * good / len(admitted), 1) if admitted else None,
        "ttft_ms": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tbt_ms": percentiles([r.tbt_s for r in ok if r.tbt_s is not None]),
        "hit_rate": {name: round(tokens / prompt, 4) if prompt else 0.0
                     for name, tokens in zip(("device", "host", "disk"), tiers, strict=True)},
        "prefix_hit_rate": round(sum(tiers) / prompt, 4) if prompt else 0.0,  # bench serve's figure
        "utilisation": busy,
        "utilisation_by_pool": _by_pool(busy),
        "window_s": round(window, 3), "makespan_s": round(result.makespan_s, 3), "wall_s": round(result.wall_s, 3),
    }
    if any(r.adapter for r in records):
        summary["adapters"] = _adapters(result, ttft_slo, tbt_slo)
    if optimum is not None:
        outcomes = [outcome(r, met(r, ttft_slo, tbt_slo), ttft_slo, tbt_slo) for r in records]
        summary["optimum"] = optimum_summary(optimum, good, window, outcomes, exact_hint(optimum))
    return summary


def _adapters(result: SimResult, ttft_slo: float, tbt_slo: float) -> dict[str, Any]:
    """Per LoRA adapter (and the base model, ""): requests and how many met both SLOs; the
    workers' adapter loads and evictions in all."""
    per: dict[str, dict[str, int]] = {}
    for r in result.records:
        row = per.setdefault(r.adapter, {"requests": 0, "slo_met": 0})
        row["requests"] += 1
        row["slo_met"] += met(r, ttft_slo, tbt_slo)
    loads = sum(n for n, _ in result.adapter_loads.values())
    evictions = sum(n for _, n in result.adapter_loads.values())
    ordered = sorted(per.items(), key=lambda kv: (-kv[1]["requests"], kv[0]))  # busiest first
    return {"per_adapter": dict(ordered), "loads": loads, "evictions": evictions,
            "max_loras": result.config.max_loras, "load_ms": result.config.adapter_load_ms}


def exact_hint(optimum: Optimum) -> str:
    """How to have `halfmoon sim` search further: the flags of the budgets that cut it."""
    flags = [*(["--optimum-seconds (0: no time limit)"] if optimum.timed_out else []),
             *(["--optimum-nodes"] if optimum.inexact_segments > optimum.timed_out else [])]
    return f"raise {' and '.join(flags)} for the exact figure" if flags else ""


def _by_pool(busy: dict[str, float]) -> dict[str, float]:
    pools: dict[str, list[float]] = {}
    for wid, share in busy.items():
        pools.setdefault(wid.split("-")[0], []).append(share)
    return {pool: round(sum(v) / len(v), 3) for pool, v in pools.items()}


def render(s: dict[str, Any]) -> str:
    rejected = ", ".join(f"{k} {v}" for k, v in sorted(s["rejected"].items())) or "none"
    return "\n".join([
        f"halfmoon sim: {s['shape']}, {s['requests']} requests over {s['window_s']:g} s "
        f"(simulated in {s['wall_s']:.2f} s)",
        f"  goodput {s['goodput_rps']} req/s ({s['goodput_per_worker']} per worker); {s['slo_met']} met "
        f"TTFT <= {s['slo']['ttft_ms']:g} ms and TBT <= {s['slo']['tbt_ms']:g} ms; admitted-ok "
        f"{s['admitted_ok_pct']}%",
        f"  rejected: {rejected}; errors {s['errors']}; cut off {s['timed_out']}",
        f"  TTFT ms p50/p90/p99 {_ps(s['ttft_ms'])}; TBT ms {_ps(s['tbt_ms'])}",
        "  prefix hits: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in s["hit_rate"].items())
        + f" (all tiers {100 * s['prefix_hit_rate']:.1f}% of prompt tokens)",
        "  utilisation: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in s["utilisation_by_pool"].items()),
        *([adapters_line(s["adapters"])] if "adapters" in s else []),
        *([optimum_line(s)] if "optimum" in s else []),
    ])


def adapters_line(a: dict[str, Any]) -> str:
    per = a["per_adapter"]
    shown = ", ".join(f"{name or 'base'} {row['slo_met']}/{row['requests']}" for name, row in list(per.items())[:8])
    more = f" (+{len(per) - 8} more)" if len(per) > 8 else ""
    return (f"  LoRA: {len(per) - ('' in per)} adapters; met/requests {shown}{more}; {a['loads']} loads, "
            f"{a['evictions']} evictions ({a['max_loras']} slots a worker, {a['load_ms']:g} ms a load)")


def optimum_line(s: dict[str, Any]) -> str:
    """The policy beside the offline optimum (sim/optimum.py) and where the two differ."""
    o, g = s["optimum"], s["optimum"]["gap"]
    lost = ", ".join(f"{k} {v}" for k, v in g["optimum_only_by_outcome"].items()) or "none"
    pct = "-" if o["pct_of_optimum"] is None else f"{o['pct_of_optimum']:g}%"
    found = "" if o["method"] == "exact" else f"; a schedule found serves {o['best_schedule']}"
    note = f"\n    {o['note']} (searched {o['search_s']:g} s)" if o.get("note") else ""
    return (f"  offline optimum: {o['served']} within SLO ({o['method']}{found}; {o['goodput_rps']} req/s): "
            f"{s['policy']} at {pct} of optimum\n"
            f"    the optimum's schedule serves {g['optimum_only']} this policy did not ({lost}); "
            f"this policy serves {g['policy_only']} outside it{note}")


def compare(summaries: Sequence[dict[str, Any]]) -> str:
    """Several policies' replays of one trace: each one's report, then a table of their goodput
    beside the offline optimum (L..U when the search ran out: a schedule found serves L, none
    serves more than U; % of optimum is then of U)."""
    head = f"{'policy':<16}{'met SLO':>9}{'goodput':>10}{'optimum':>10}{'% of optimum':>14}  rejected"
    rows = []
    for s in summaries:
        o = s.get("optimum")
        pct = "-" if o is None or o["pct_of_optimum"] is None else f"{o['pct_of_optimum']:g}%"
        optimum = "-" if o is None else optimum_cell(o)
        rejected = ", ".join(f"{k} {v}" for k, v in sorted(s["rejected"].items())) or "none"
        rows.append(f"{s['policy']:<16}{s['slo_met']:>9}{s['goodput_rps']:>10}{optimum:>10}{pct:>14}  {rejected}")
    return "\n\n".join([*(render(s) for s in summaries), "\n".join([head, *rows])])


def _ps(p: dict[str, float | None]) -> str:
    return "/".join("-" if v is None else f"{v:g}" for v in p.values())


def plot(result: SimResult, path: str | Path) -> str:
    """TTFT and TBT CDFs against the SLO lines, and each worker's utilisation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ttft_slo, tbt_slo = objectives(result)
    ok = [r for r in result.records if r.status == "ok"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, values, slo, title in ((axes[0], [r.ttft_s for r in ok if r.ttft_s is not None], ttft_slo, "TTFT"),
                                   (axes[1], [r.tbt_s for r in ok if r.tbt_s is not None], tbt_slo, "TBT")):
        ms = np.sort(np.asarray(values, dtype=np.float64) * 1e3)
        if len(ms):
            ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms))
        if math.isfinite(slo):
            ax.axvline(slo, color="tab:red", linestyle="--", label=f"SLO {slo:g} ms")
            ax.legend()
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("share of completed requests")
        ax.grid(alpha=0.3)
    span = result.makespan_s or 1.0
    names = list(result.busy_s)
    axes[2].bar(names, [100 * result.busy_s[n] / span for n in names])
    axes[2].set_ylabel("busy (% of the makespan)")
    axes[2].tick_params(axis="x", labelrotation=45)
    fig.suptitle(f"halfmoon sim: {result.config.shape}, {len(result.records)} requests")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)
