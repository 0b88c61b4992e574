"""The admission window against the offline optimum in the simulator (issue 38): every trace x
load x window through `halfmoon sim --json` (the Conductor's own admission on simulated time),
printed as a Markdown table and plotted as % of the optimum.

    python -m halfmoon.bench.admission_window_sweep --cost-model PROFILE.json --out docs/figures/admission_window
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

TRACES = {"bursty seed 0": ["--synthetic", "bursty", "--seed", "0"],
          "bursty seed 1": ["--synthetic", "bursty", "--seed", "1"],
          "bursty seed 2": ["--synthetic", "bursty", "--seed", "2"],
          "sample trace": ["--trace", "bench/data/sample_trace.jsonl"]}


def cell(cost_model: str, source: list[str], speed: float, window_ms: float) -> dict:
    """One `halfmoon sim` replay under predictive admission, beside its optimum."""
    command = [sys.executable, "-m", "halfmoon.cli.main", "sim", *source, "--speed", str(speed), "--cost-model", cost_model,
               "--policies", "predictive", "--admit-window-ms", str(window_ms), "--no-progress", "--json"]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    summary = json.loads(out)
    summary = summary["policies"][0] if "policies" in summary else summary
    optimum = summary["optimum"]
    return {"met": summary["slo_met"], "admitted": summary["admitted"], "ok_pct": summary["admitted_ok_pct"],
            "optimum": optimum["served"], "exact": optimum["method"] == "exact",
            "pct": optimum["pct_of_optimum"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cost-model", required=True)
    p.add_argument("--speeds", default="1,3")
    p.add_argument("--windows", default="0,20")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    speeds = [float(s) for s in args.speeds.split(",")]
    windows = [float(w) for w in args.windows.split(",")]
    rows = {(t, s, w): cell(args.cost_model, src, s, w) for t, src in TRACES.items() for s in speeds for w in windows}
    print("| trace | load | window ms | admitted | met | optimum | %opt | admitted within SLO % |")
    print("|---|---|---|---|---|---|---|---|")
    for (t, s, w), r in rows.items():
        bound = "" if r["exact"] else " (bound)"
        print(f"| {t} | {s:g}x | {w:g} | {r['admitted']} | {r['met']} | {r['optimum']}{bound} | {r['pct']} | "
              f"{r['ok_pct']} |")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "admission_window_sweep.json").write_text(json.dumps(
            [{"trace": t, "speed": s, "window_ms": w, **r} for (t, s, w), r in rows.items()], indent=1) + "\n")
        plot(rows, speeds, windows, out / "admission_window_pct_of_optimum.png")
    return 0


def plot(rows: dict, speeds: list[float], windows: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{t}\n{s:g}x" for t in TRACES for s in speeds]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(windows)
    for i, w in enumerate(windows):
        values = [rows[(t, s, w)]["pct"] for t in TRACES for s in speeds]
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=f"window {w:g} ms")
    ax.axhline(85, color="k", linestyle="--", linewidth=1, label="target 85%")
    ax.set_xticks([x + width * (len(windows) - 1) / 2 for x in range(len(labels))], labels, fontsize=8)
    ax.set_ylabel("% of the offline optimum (met both SLOs)")
    ax.set_title("predictive admission, halfmoon sim 1P1D (CPU fp32 profile)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
