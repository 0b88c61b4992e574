"""What a planned replay (sim/planned.py) did, as text, JSON and a timeline plot: the decisions,
the moves, the split over time and the goodput of each stretch of the trace (`halfmoon sim
--planner`, `halfmoon bench planner-sim`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from halfmoon.conductor.planner import Split
from halfmoon.sim.cluster import SimResult
from halfmoon.sim.planned import PlannedResult
from halfmoon.sim.report import met, objectives


def goodput_between(result: SimResult, start_s: float, end_s: float) -> float:
    """Requests/s meeting both SLOs among those arriving in [start_s, end_s)."""
    ttft_ms, tbt_ms = objectives(result)
    good = sum(met(r, ttft_ms, tbt_ms) for r in result.records if start_s <= r.arrival_s < end_s)
    return good / (end_s - start_s) if end_s > start_s else 0.0


def planned_summary(planned: PlannedResult) -> dict[str, Any]:
    """The planner's part of a replay's summary (beside sim/report.py's `summarize`)."""
    moves = planned.moves
    return {
        "final_split": str(planned.final_split),
        "decisions": [d.view() | {"scores": {}} for d in planned.decisions if d.moves],
        "counts": dict(Counter(d.action for d in planned.decisions)),
        "moves": len(moves), "drains_overran": sum(m.overran for m in moves),
        "ticks_skipped_moving": planned.skipped,
        "splits": [[round(t, 3), str(s)] for t, s in planned.splits],
    }


def render_planned(planned: PlannedResult, mode: str, limit: int = 40) -> str:
    """The decisions that moved (or would have, advised), the counts and the final split."""
    s = planned_summary(planned)
    counts = ", ".join(f"{k} {v}" for k, v in sorted(s["counts"].items())) or "none"
    lines = [f"planner ({mode}): {len(planned.decisions)} ticks ({counts}); {s['moves']} moves made, "
             f"{s['drains_overran']} decode drains past drain_s, {s['ticks_skipped_moving']} ticks skipped "
             f"while a move ran; split {planned.splits[0][1]} -> {s['final_split']}"]
    moved = [d for d in planned.decisions if d.moves]
    for d in moved[:limit]:
        role = f" {d.role}" if d.role else ""
        lines.append(f"  {d.at:8.1f} s  {d.action}{role:8s} {d.current} -> {d.next_split}"
                     f"{'' if d.applied else ' (advised)'}: {d.reason}")
    if len(moved) > limit:
        lines.append(f"  ... {len(moved) - limit} more (--json lists them all)")
    return "\n".join(lines)


def plot_splits(series: dict[str, Sequence[tuple[float, Split]]], path: str | Path, end_s: float,
                phases: Sequence[tuple[str, float, float]] = (), title: str = "") -> str:
    """Prefill workers over time per named series (a step line each), the phases shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(11, 4))
    for i, (name, start, end) in enumerate(phases):
        ax.axvspan(start, end, color=("tab:blue", "tab:orange")[i % 2], alpha=0.08)
        ax.text((start + end) / 2, 1.0, name, transform=ax.get_xaxis_transform(), ha="center", va="bottom")
    for name, points in series.items():
        times = [t for t, _ in points] + [end_s]
        prefill = [s.prefill for _, s in points] + [points[-1][1].prefill]
        ax.step(times, prefill, where="post", label=name)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("prefill workers (the rest decode)")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(0, end_s)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    if title:
        ax.set_title(title, pad=18)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
