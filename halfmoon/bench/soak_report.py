"""The soak's verdict and its pictures: outcome counts, greedy mismatches, RSS growth per process
after warm-up, restart-to-serving per fault kind (and whether it grows over the run), the
must-hold checks, the printed summary and the timeline plot."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

RSS_GROWTH_LIMIT = 0.05
PROCESS_WARM_S = 60.0  # a restarted process's own warm-up, left out of its growth
BUCKET_S = 10.0


def outcome_counts(outcomes: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for o in outcomes:
        counts[o["status"].split(":")[0] if o["status"] == "ok" else o["status"]] += 1
    return dict(sorted(counts.items()))


def rss_growth(rss: list[dict[str, Any]], mark_s: float) -> dict[str, dict[str, Any]]:
    """Per process label: RSS growth of its longest-lived process after `mark_s` (the median of
    the first fifth of its samples after the mark vs the median of the last fifth). A process
    restarted by a fault is measured from `PROCESS_WARM_S` after its first sample (its own warm-up)."""
    born: dict[tuple[str, int], float] = {}
    for s in rss:
        born.setdefault((s["label"], s["pid"]), s["t"])
    lives: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for s in rss:
        life = (s["label"], s["pid"])
        if s["t"] >= mark_s and s["t"] >= born[life] + PROCESS_WARM_S:
            lives[life].append((s["t"], s["rss_mib"]))
    best: dict[str, list[tuple[float, float]]] = {}
    for (label, _), samples in lives.items():
        if len(samples) > len(best.get(label, [])):
            best[label] = samples
    out = {}
    for label, samples in sorted(best.items()):
        if len(samples) < 5:
            continue
        k = max(1, len(samples) // 5)
        first, last = statistics.median(v for _, v in samples[:k]), statistics.median(v for _, v in samples[-k:])
        out[label] = {"from_s": samples[0][0], "to_s": samples[-1][0], "first_mib": first, "last_mib": last,
                      "growth": round(last / first - 1, 4) if first else 0.0}
    return out


def restart_trend(faults: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per fault kind with a restart: its restart-to-serving times in order, the median of the
    first and of the second half, and whether the second half is more than 1.5x the first."""
    out = {}
    for kind in sorted({f["kind"] for f in faults}):
        times = [f["restart_to_serving_s"] for f in faults if f["kind"] == kind and f["restart_to_serving_s"] is not None]
        if not times:
            continue
        half = max(1, len(times) // 2)
        a, b = statistics.median(times[:half]), statistics.median(times[half:] or times)
        out[kind] = {"times_s": times, "median_s": round(statistics.median(times), 3),
                     "first_half_s": round(a, 3), "second_half_s": round(b, 3),
                     "growing": len(times) >= 4 and b > 1.5 * a + 0.5}
    return out


def verdict(result: dict[str, Any]) -> list[str]:
    """Every must-hold that failed, in words (empty: all hold)."""
    failed = []
    counts = result["counts"]
    errors = sum(n for k, n in counts.items() if k.startswith("error"))
    if errors:
        failed.append(f"{errors} client-visible errors")
    if result["mismatches"]:
        failed.append(f"{result['mismatches']} completed greedy streams differ from the undisturbed run")
    for label, g in result["rss_growth"].items():
        if g["growth"] >= RSS_GROWTH_LIMIT:
            failed.append(f"RSS of {label} grew {g['growth']:.1%} after warm-up")
    if not all(c["ok"] for c in result["integrity"].values()):
        failed.append("integrity checks failed: " + "; ".join(
            f"{w}: {c}" for w, c in result["integrity"].items() if not c["ok"]))
    if any(result["leases"].values()):
        failed.append(f"left in the index: {result['leases']}")
    if not result["agreement"]["agree"]:
        failed.append("/health, /metrics, dashboard disagree with integrity: " + "; ".join(result["agreement"]["problems"]))
    for kind, t in result["restarts"].items():
        if t["growing"]:
            failed.append(f"restart-to-serving of {kind} grows: {t['first_half_s']} s -> {t['second_half_s']} s")
    unrecovered = [f for f in result["faults"] if f["note"].startswith(("not serving", "strike failed", "not struck"))]
    if unrecovered:
        failed.append(f"{len(unrecovered)} faults not struck or not recovered: {unrecovered[:3]}")
    return failed


def render(result: dict[str, Any]) -> str:
    lines = [f"halfmoon bench soak: {result['minutes']} min, seed {result['seed']}, {result['rps']} req/s open loop "
             f"from {result['trace']} (1P2D), faults {result['faults_mode']}"]
    for why in result["excluded"]:
        lines.append(f"EXCLUDED: {why}")
    lines.append("faults per kind: " + ", ".join(f"{k} {n}" for k, n in result["fault_counts"].items()))
    lines.append("outcomes: " + ", ".join(f"{k} {n}" for k, n in result["counts"].items())
                 + f"; greedy mismatches {result['mismatches']} of {result['compared']} compared")
    lines.append(f"TTFT p50 {result['ttft_p50_s']} s, p90 {result['ttft_p90_s']} s")
    lines.append(f"{'restart-to-serving':24}{'n':>4}{'median s':>10}{'1st half':>10}{'2nd half':>10}")
    for kind, t in result["restarts"].items():
        lines.append(f"{kind:24}{len(t['times_s']):>4}{t['median_s']:>10.2f}{t['first_half_s']:>10.2f}"
                     f"{t['second_half_s']:>10.2f}{'  GROWING' if t['growing'] else ''}")
    lines.append(f"RSS growth after {result['warm_mark_s']:.0f} s (longest-lived process per label):")
    for label, g in result["rss_growth"].items():
        lines.append(f"  {label:28}{g['first_mib']:>9.1f} -> {g['last_mib']:>9.1f} MiB  {g['growth']:+.2%}")
    bad = {w: c for w, c in result["integrity"].items() if not c["ok"]}
    lines.append(f"integrity: {len(result['integrity']) - len(bad)}/{len(result['integrity'])} workers clean; "
                 f"index leftovers {result['leases']}; /health, /metrics, dashboard agree: "
                 f"{result['agreement']['agree']}")
    lines.append("MUST-HOLD: all hold" if not result["failed"] else "MUST-HOLD FAILED:\n  " + "\n  ".join(result["failed"]))
    return "\n".join(lines)


def plot(result: dict[str, Any], rss: list[dict[str, Any]], blocks: list[dict[str, Any]], path: Path) -> None:
    """Timeline: goodput and TTFT p90 per 10 s, RSS per process, free blocks per pool; faults marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(12, 11), sharex=True)
    outs = result["outcomes"]
    end = max([o["end_s"] or 0 for o in outs] + [1.0])
    edges = [i * BUCKET_S for i in range(int(end // BUCKET_S) + 2)]
    good = [sum(1 for o in outs if o["status"] == "ok" and e <= o["end_s"] < e + BUCKET_S) / BUCKET_S for e in edges]
    p90 = []
    for e in edges:
        ttfts = sorted(o["ttft_s"] for o in outs if o["ttft_s"] is not None and e <= o["sent_s"] < e + BUCKET_S)
        p90.append(ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else float("nan"))
    axes[0].step(edges, good, where="post")
    axes[0].set_ylabel("goodput (ok req/s)")
    axes[1].plot(edges, p90, marker=".")
    axes[1].set_ylabel("TTFT p90 (s)")
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for s in rss:
        series[s["label"]].append((s["t"], s["rss_mib"]))
    for label, pts in sorted(series.items()):
        if max(v for _, v in pts) >= 50:  # the big processes; Ray's small helpers clutter
            axes[2].plot(*zip(*pts, strict=True), label=label, lw=1)
    axes[2].set_ylabel("RSS (MiB)")
    axes[2].legend(fontsize=7, ncol=3)
    pools: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for b in blocks:
        pools[b["worker"]].append((b["t"], b["free"]))
    for worker, pts in sorted(pools.items()):
        axes[3].plot(*zip(*pts, strict=True), label=worker, lw=1)
    axes[3].set_ylabel("free device blocks")
    axes[3].legend(fontsize=7)
    axes[3].set_xlabel("seconds since the load started")
    colors = dict(zip(sorted({f["kind"] for f in result["faults"]}), plt.cm.tab10.colors, strict=False))
    for f in result["faults"]:
        if f["struck_s"] is None:
            continue
        for ax in axes:
            until = max(f["ended_s"] or 0, f["recovered_s"] or 0, f["struck_s"] + 0.5)  # a kill: until serving again
            ax.axvspan(f["struck_s"], until,
                       color=colors[f["kind"]], alpha=0.25, lw=0)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=0.4) for c in colors.values()]
    axes[0].legend(handles, list(colors), fontsize=7, ncol=len(colors), loc="upper left")
    fig.suptitle(f"halfmoon bench soak: {result['minutes']} min, seed {result['seed']}, faults shaded")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
