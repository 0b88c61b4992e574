"""`halfmoon sim sweep`: every prefill:decode split of a worker budget, times every tier size on a
grid, each replayed through a fresh simulated cluster; the best shape is the one with the most
goodput per worker (ties: more goodput, then fewer prefill workers)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from conductor.cost_model import CostModel
from conductor.serve_defaults import gib_for_tokens
from core.errors import ConfigError
from sim.cluster import SimConfig, simulate
from sim.report import summarize
from sim.workload import Workload


@dataclass(frozen=True, slots=True)
class Grid:
    """The shapes to try: `workers` split every way into P >= 1 prefill and D >= 1 decode, each
    with every (device, host) tier size listed (tokens per worker)."""

    workers: int
    device_tokens: tuple[int, ...]
    host_tokens: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if self.workers < 2:
            raise ConfigError(f"a sweep needs a budget of >= 2 workers (1 prefill + 1 decode), got {self.workers}")
        if not self.device_tokens or not self.host_tokens:
            raise ConfigError("the sweep's tier-size grids must not be empty")

    def shapes(self, base: SimConfig) -> list[SimConfig]:
        return [replace(base, prefill=p, decode=self.workers - p, colocated=False, device_tokens=dev,
                        host_tokens=host)
                for p, dev, host in itertools.product(range(1, self.workers), self.device_tokens,
                                                      self.host_tokens)]


def sweep(workload: Workload, grid: Grid, base: SimConfig, cost: CostModel,
          tick: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every shape of the grid; the rows in grid order and the recommended one."""
    rows = []
    for config in grid.shapes(base):
        summary = summarize(simulate(workload, config, cost))
        row = {"prefill": config.prefill, "decode": config.decode, "device_tokens": config.device_tokens,
               "host_tokens": config.host_tokens, **summary}
        rows.append(row)
        if tick is not None:
            tick(row)
    best = max(rows, key=lambda r: (r["goodput_per_worker"] or 0.0, r["goodput_rps"] or 0.0, -r["prefill"]))
    return {"workers": grid.workers, "rows": rows, "best": best,
            "helm_values": helm_values(best, base.block_size, cost.kv_bytes_per_token)}


def helm_values(row: dict[str, Any], block_size: int, kv_bytes_per_token: int) -> str:
    """The recommended shape as the chart's values (helm/halfmoon/values.yaml): replicas per
    role, each worker's device KV in blocks, its host tier in GiB (`--host-cache-gb`'s unit),
    rounded up to a tenth."""
    host_gb = math.ceil(gib_for_tokens(row["host_tokens"], kv_bytes_per_token) * 10) / 10
    return "\n".join([
        "prefill:",
        f"  replicas: {row['prefill']}",
        "decode:",
        f"  replicas: {row['decode']}",
        "engine:",
        f"  blockSize: {block_size}",
        f"  numBlocks: {max(1, row['device_tokens'] // block_size)}",
        "kvTiers:",
        f"  hostGb: {host_gb:g}",
        "",
    ])


def render(result: dict[str, Any]) -> str:
    lines = [f"halfmoon sim sweep: {result['workers']} workers, {len(result['rows'])} shapes",
             f"{'P:D':>5} {'device':>8} {'host':>8} {'goodput':>8} {'/worker':>8} {'adm-ok%':>8} "
             f"{'TTFT p90':>9} {'TBT p90':>8} {'rejected':>8} {'sim s':>6}"]
    for r in result["rows"]:
        mark = " <- best" if r is result["best"] else ""
        lines.append(f"{r['prefill']:>2}:{r['decode']:<2} {r['device_tokens']:>8} {r['host_tokens']:>8} "
                     f"{r['goodput_rps'] or 0:>8.3f} {r['goodput_per_worker'] or 0:>8.4f} "
                     f"{r['admitted_ok_pct'] if r['admitted_ok_pct'] is not None else '-':>8} "
                     f"{r['ttft_ms']['p90'] or '-':>9} {r['tbt_ms']['p90'] or '-':>8} "
                     f"{sum(r['rejected'].values()):>8} {r['wall_s']:>6.2f}{mark}")
    lines += ["recommended Helm values:", result["helm_values"]]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str | Path) -> str:
    """Goodput per worker of every shape (bars grouped by P:D), the best marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: Sequence[dict[str, Any]] = result["rows"]
    labels = [f"{r['prefill']}P{r['decode']}D\n{r['device_tokens'] // 1024}k/{r['host_tokens'] // 1024}k"
              for r in rows]
    values = [r["goodput_per_worker"] or 0.0 for r in rows]
    colors = ["tab:green" if r is result["best"] else "tab:blue" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(rows)), 3.8))
    ax.bar(range(len(rows)), values, color=colors)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("goodput per worker (req/s)")
    ax.set_title(f"halfmoon sim sweep: {result['workers']} workers (device/host k tokens; best in green)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)
