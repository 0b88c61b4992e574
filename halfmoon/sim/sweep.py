"""`halfmoon sim sweep`: every tensor-parallel layout (prefill TP, decode TP) with a profile, every
prefill:decode split of a device budget, times every tier size on a grid, each replayed through a
fresh simulated cluster; the best shape is the one with the most goodput per device (ties: more
goodput, then fewer prefill workers). With every worker at TP=1 a device is a worker.

A layout's cost model is `CostModel.with_decode_of`: prefill from the TP=p profile, decode steps
from the TP=d one (`halfmoon profile --tp N` per size). Tensor-parallel workers keep no host tier
(docs/OPERATIONS.md), so a layout with TP > 1 is tried with host tokens 0 only."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.serve_defaults import gib_for_tokens
from halfmoon.core.errors import ConfigError
from halfmoon.sim.cluster import SimConfig, simulate
from halfmoon.sim.report import summarize
from halfmoon.sim.workload import Workload


@dataclass(frozen=True, slots=True)
class Grid:
    """The shapes to try: per layout (prefill TP p, decode TP d), the device budget `workers`
    split every way into P >= 1 prefill workers and the most decode workers D >= 1 the rest
    holds (P x p + D x d <= workers; at TP 1:1, P + D = workers), each with every (device, host)
    tier size listed (tokens per worker; host only 0 when a worker is tensor-parallel)."""

    workers: int
    device_tokens: tuple[int, ...]
    host_tokens: tuple[int, ...] = (0,)
    layouts: tuple[tuple[int, int], ...] = ((1, 1),)

    def __post_init__(self) -> None:
        if not self.layouts or any(p < 1 or d < 1 for p, d in self.layouts):
            raise ConfigError(f"the sweep's layouts must be (prefill tp, decode tp) pairs >= 1, got {self.layouts}")
        least = min(p + d for p, d in self.layouts)
        if self.workers < max(2, least):
            raise ConfigError(f"a sweep needs a budget of >= {max(2, least)} devices (1 prefill + 1 decode worker "
                              f"of the smallest layout), got {self.workers}")
        if not self.device_tokens or not self.host_tokens:
            raise ConfigError("the sweep's tier-size grids must not be empty")

    def shapes(self, base: SimConfig) -> list[SimConfig]:
        out = []
        for (tp_p, tp_d), p in itertools.product(self.layouts, range(1, self.workers)):
            d = (self.workers - p * tp_p) // tp_d
            if d < 1:
                continue
            hosts = self.host_tokens if (tp_p, tp_d) == (1, 1) else (0,)  # TP workers keep no host tier
            out += [replace(base, prefill=p, decode=d, colocated=False, device_tokens=dev, host_tokens=host,
                            prefill_tp=tp_p, decode_tp=tp_d)
                    for dev, host in itertools.product(self.device_tokens, hosts)]
        return out


def layout_cost(tp_costs: Mapping[int, CostModel], prefill_tp: int, decode_tp: int) -> CostModel:
    """The cost model of a layout from the profiles per tensor-parallel size."""
    missing = sorted({prefill_tp, decode_tp} - set(tp_costs))
    if missing:
        raise ConfigError(f"no profile for tp {missing}: `halfmoon profile --tp N` per size of a layout")
    if prefill_tp == decode_tp:
        return tp_costs[prefill_tp]
    return tp_costs[prefill_tp].with_decode_of(tp_costs[decode_tp])


def sweep(workload: Workload, grid: Grid, base: SimConfig, cost: CostModel,
          tick: Callable[[dict[str, Any]], None] | None = None,
          tp_costs: Mapping[int, CostModel] | None = None) -> dict[str, Any]:
    """Every shape of the grid; the rows in grid order and the recommended one. `cost` is the
    TP=1 workers' profile; `tp_costs`: the profile of each tensor-parallel size the grid's
    layouts use (TP=1: `cost` unless given)."""
    costs = {1: cost, **(tp_costs or {})}
    rows = []
    for config in grid.shapes(base):
        summary = summarize(simulate(workload, config, layout_cost(costs, config.prefill_tp, config.decode_tp)))
        row = {"prefill": config.prefill, "decode": config.decode, "prefill_tp": config.prefill_tp,
               "decode_tp": config.decode_tp, "device_tokens": config.device_tokens,
               "host_tokens": config.host_tokens, **summary}
        rows.append(row)
        if tick is not None:
            tick(row)
    best = max(rows, key=lambda r: (r["goodput_per_device"] or 0.0, r["goodput_rps"] or 0.0, -r["prefill"]))
    return {"workers": grid.workers, "rows": rows, "best": best,
            "helm_values": helm_values(best, base.block_size, cost.kv_bytes_per_token)}


def helm_values(row: dict[str, Any], block_size: int, kv_bytes_per_token: int) -> str:
    """The recommended shape as the chart's values (helm/halfmoon/values.yaml): replicas and
    tensor-parallel size per role, each worker's device KV in blocks, its host tier in GiB
    (`--host-cache-gb`'s unit), rounded up to a tenth."""
    host_gb = math.ceil(gib_for_tokens(row["host_tokens"], kv_bytes_per_token) * 10) / 10
    return "\n".join([
        "prefill:",
        f"  replicas: {row['prefill']}",
        f"  tp: {row.get('prefill_tp', 1)}",
        "decode:",
        f"  replicas: {row['decode']}",
        f"  tp: {row.get('decode_tp', 1)}",
        "engine:",
        f"  blockSize: {block_size}",
        f"  numBlocks: {max(1, row['device_tokens'] // block_size)}",
        "kvTiers:",
        f"  hostGb: {host_gb:g}",
        "",
    ])


def render(result: dict[str, Any]) -> str:
    lines = [f"halfmoon sim sweep: {result['workers']} devices, {len(result['rows'])} shapes",
             f"{'P:D':>5} {'tp':>5} {'device':>8} {'host':>8} {'goodput':>8} {'/device':>8} {'adm-ok%':>8} "
             f"{'TTFT p90':>9} {'TBT p90':>8} {'rejected':>8} {'sim s':>6}"]
    for r in result["rows"]:
        mark = " <- best" if r is result["best"] else ""
        lines.append(f"{r['prefill']:>2}:{r['decode']:<2} {r['prefill_tp']:>2}:{r['decode_tp']:<2} "
                     f"{r['device_tokens']:>8} {r['host_tokens']:>8} "
                     f"{r['goodput_rps'] or 0:>8.3f} {r['goodput_per_device'] or 0:>8.4f} "
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
    labels = [f"{r['prefill']}P{r['decode']}D tp{r['prefill_tp']}:{r['decode_tp']}\n"
              f"{r['device_tokens'] // 1024}k/{r['host_tokens'] // 1024}k" for r in rows]
    values = [r["goodput_per_device"] or 0.0 for r in rows]
    colors = ["tab:green" if r is result["best"] else "tab:blue" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(rows)), 3.8))
    ax.bar(range(len(rows)), values, color=colors)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("goodput per device (req/s)")
    ax.set_title(f"halfmoon sim sweep: {result['workers']} devices (device/host k tokens; best in green)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)
