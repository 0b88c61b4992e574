"""What the admission benchmark prints and draws: a table per mode (policy x load), the
calibration and the verdict lines, and the plots (goodput vs offered load per policy, the TTFT
CDF per policy at the highest load). Figures are reported, never asserted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from halfmoon.bench.admission_metrics import (ADMITTED_OK_PCT, COLLAPSE_OF_BEST_PCT, GOODPUT_OF_BEST_PCT, OVERLOAD,
                                     best_goodput, goodput, pct_of_best)
from halfmoon.bench.report import ruled
from halfmoon.sim.optimum_jobs import optimum_cell

# (header, width, the cell of a run)
COLUMNS: tuple[tuple[str, int, Any], ...] = (
    ("policy", 16, lambda run, best: run["policy"]),
    ("load", 6, lambda run, best: f"{run['load']:g}x"),
    ("offered", 9, lambda run, best: _num(run["metrics"]["offered_rps"], 3)),
    ("sent", 6, lambda run, best: str(run["metrics"]["requests"])),
    ("rej", 5, lambda run, best: str(run["metrics"]["rejected"])),
    ("5xx", 5, lambda run, best: str(run["metrics"]["errors_5xx"])),
    ("cut", 5, lambda run, best: str(run["metrics"]["timed_out"])),
    ("goodput", 9, lambda run, best: _num(goodput(run), 3)),
    ("%best", 7, lambda run, best: _num(pct_of_best(goodput(run), best))),
    ("met", 5, lambda run, best: str(run["metrics"].get("slo_met", "-"))),
    ("optimum", 10, lambda run, best: _optimum(run)),
    ("%opt", 7, lambda run, best: _num((run.get("optimum") or {}).get("pct_of_optimum"))),
    ("adm-ok%", 9, lambda run, best: _num(run["metrics"]["admitted_ok_pct"])),
    ("wasted-pf", 11, lambda run, best: str(run["metrics"]["wasted_prefill_tokens"])),
    ("TTFT p90", 10, lambda run, best: _num(run["metrics"]["ttft_ms"]["p90"], 0)),
    ("TBT p90", 9, lambda run, best: _num(run["metrics"]["tbt_ms"]["p90"], 0)),
    ("ttft-err%", 11, lambda run, best: _num(run["metrics"]["ttft_prediction_error_pct"])),
    ("tbt-err%", 10, lambda run, best: _num(run["metrics"]["tbt_prediction_error_pct"])),
    ("hb-gap-s", 10, lambda run, best: _num(run["index"]["heartbeat_max_gap_s"], 2)),
    ("resyncs", 9, lambda run, best: _num(run["index"]["resyncs"], 0)),
)


def _optimum(run: dict[str, Any]) -> str:
    """The replay's offline optimum (bench/admission_optimum.py): N, L..U out of budget, - without."""
    o = run.get("optimum") or {}
    return optimum_cell(o) if "served" in o else "-"


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render_mode_table(runs: list[dict[str, Any]]) -> str:
    """One row per (policy, load); %best is of the best goodput any of these runs achieved."""
    best = best_goodput(runs)
    head = "".join(_cell(name, width, i) for i, (name, width, _) in enumerate(COLUMNS))
    rows = ("".join(_cell(cell(run, best), width, i) for i, (_, width, cell) in enumerate(COLUMNS))
            for run in runs)
    return ruled(head, rows)


def _cell(text: str, width: int, column: int) -> str:
    return f"{text:<{width}}" if column == 0 else f"{text:>{width}}"


def calibration_line(mode: str, calibration: dict[str, Any], rate_at_1x: float) -> str:
    probes = ", ".join(f"x{p['speed']:.3g} -> {p['slo_attainment_pct']:.0f}%" for p in calibration["probes"])
    if calibration.get("given"):
        return f"{mode}: base speed x{calibration['speed']:.3g} given (--base-speed), " \
               f"{calibration['rate_rps']:.3f} req/s (trace: {rate_at_1x:.3f} req/s at x1)"
    if calibration["speed"] is None:
        return f"{mode}: no probe met the attainment target ({probes}); loads are multiples of " \
               f"the slowest probe, x{calibration['used_speed']:.3g}"
    return (f"{mode}: sustains x{calibration['speed']:.3g} = {calibration['rate_rps']:.3f} req/s within SLO "
            f"(probes: {probes})")


def verdict_line(mode: str, verdict: dict[str, Any]) -> str:
    """The issue's targets for one mode, stated whatever the outcome."""
    met = {None: "not judged", True: "MET", False: "MISSED"}
    targets = (f"predictive at >= {OVERLOAD:g}x: goodput >= {GOODPUT_OF_BEST_PCT:g}% of the best, "
               f">= {ADMITTED_OK_PCT:g}% of admitted meet both SLOs, zero 5xx: {met[verdict['predictive_met']]}")
    collapsed = {None: "not judged", True: "yes", False: "NO"}[verdict["none_collapsed"]]
    line = (f"verdict {mode}: {targets}; none collapses (goodput at the highest load < "
            f"{COLLAPSE_OF_BEST_PCT:g}% of the best): {collapsed}")
    return line + "".join(f"\n  - {reason}" for reason in verdict["reasons"])


def render(result: dict[str, Any]) -> str:
    slo = result["slo"]
    loads = ", ".join(f"{x:g}x" for x in result["loads"])
    head = (f"halfmoon bench serve --admission: {result['trace']}; window {result['window_s']:g} s per replay; "
            f"SLO TTFT <= {slo['ttft_ms']:g} ms, TBT <= {slo['tbt_ms']:g} ms (the server's class SLO); "
            f"loads {loads} of each mode's calibrated rate")
    parts = [head, f"machine: {result['machine']['cpu']}, {result['machine']['cores']} cores"]
    for mode, entry in result["modes"].items():
        parts.append(f"== {mode}: halfmoon serve {entry['serve_args']}\n"
                     + calibration_line(mode, entry["calibration"], result["trace_rate_rps"]) + "\n"
                     + render_mode_table(entry["runs"]) + "\n"
                     + verdict_line(mode, entry["verdict"]))
    bases = {run.get("goodput_basis", "window") for entry in result["modes"].values() for run in entry["runs"]}
    parts.append(f"goodput per second of the replay's {' / '.join(sorted(bases))} (bench/admission_metrics.py)")
    parts.append("columns: offered/goodput req/s; rej = RESOURCE_EXHAUSTED; 5xx = any other status; cut = "
                 "still running at the replay's deadline; adm-ok% = admitted meeting both SLOs; wasted-pf = "
                 "prefill tokens of admitted requests that missed; *-err% = median |predicted - measured| / "
                 "measured; hb-gap-s, resyncs = the index heartbeat from /metrics (- = not exported); met = "
                 "requests meeting both SLOs; optimum = the most any admission policy could have served of "
                 "the replay (sim/optimum.py's model on the server's cost model; L..U: the search ran out), "
                 "%opt = met / optimum")
    parts.extend(gap_lines(result))
    return "\n\n".join(parts)


def gap_lines(result: dict[str, Any]) -> list[str]:
    """Per run, the requests the optimum's schedule serves and the policy did not, by outcome
    (where the policy loses to the optimum), or why there is no optimum."""
    lines = []
    for entry in result["modes"].values():
        for run in entry["runs"]:
            o = run.get("optimum") or {}
            name = f"{run['mode']} {run['policy']} {run['load']:g}x"
            if "error" in o:
                lines.append(f"{name}: no optimum ({o['error']})")
            elif "gap" in o:
                lost = ", ".join(f"{k} {v}" for k, v in o["gap"]["optimum_only_by_outcome"].items()) or "none"
                lines.append(f"{name}: the optimum's schedule serves {o['gap']['optimum_only']} it did not "
                             f"({lost}); it serves {o['gap']['policy_only']} outside that schedule")
    return ["vs the offline optimum:\n  " + "\n  ".join(lines)] if lines else []


# ---------------------------------------------------------------------------- plots


def plot(out: Path, modes: dict[str, dict[str, Any]], slo_ttft_ms: float) -> list[str]:
    """Per mode: goodput vs offered load (a line per policy) and the TTFT CDF per policy at the
    highest load; the files written."""
    import matplotlib

    matplotlib.use("Agg")
    written = []
    for mode, entry in modes.items():
        runs = entry["runs"]
        written.append(_goodput_plot(out / f"admission_goodput_{mode}.png", mode, runs))
        written.append(_ttft_cdf(out / f"admission_ttft_cdf_{mode}.png", mode, runs, slo_ttft_ms))
    return written


def _policies(runs: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(run["policy"] for run in runs))


def _goodput_plot(path: Path, mode: str, runs: list[dict[str, Any]]) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for policy in _policies(runs):
        mine = sorted((r["metrics"]["offered_rps"] or 0.0, goodput(r) or 0.0)
                      for r in runs if r["policy"] == policy)
        ax.plot([x for x, _ in mine], [y for _, y in mine], marker="o", label=policy)
    offered = sorted({r["metrics"]["offered_rps"] or 0.0 for r in runs})
    ax.plot(offered, offered, color="grey", linestyle="--", label="offered load")
    ax.set(xlabel="offered load (req/s)", ylabel="goodput (req/s meeting both SLOs)",
           title=f"admission control, {mode}: goodput vs offered load")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _ttft_cdf(path: Path, mode: str, runs: list[dict[str, Any]], slo_ttft_ms: float) -> str:
    """Over all requests sent: a rejected or failed request never gets a first token, so a
    policy's curve tops out at its completed share."""
    import matplotlib.pyplot as plt

    top = max(run["load"] for run in runs)
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in (r for r in runs if r["load"] == top):
        values = sorted(r["ttft_ms"] for r in run["requests"] if r["status"] == "ok" and r["ttft_ms"] is not None)
        if values:
            ax.step(values, np.arange(1, len(values) + 1) / len(run["requests"]), where="post", label=run["policy"])
        else:  # in the legend all the same
            ax.plot([], [], label=f"{run['policy']} (no request completed)")
    ax.axvline(slo_ttft_ms, color="grey", linestyle="--", label=f"SLO {slo_ttft_ms:g} ms")
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests sent", ylim=(0, 1.02),
           title=f"admission control, {mode}: TTFT CDF at {top:g}x")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)
