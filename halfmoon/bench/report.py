"""What every `halfmoon bench <name>` reports: figures against a baseline, the machine, progress.

A `Figure` is one quantity measured for Halfmoon and for its baseline in the same run; its ratio
is always halfmoon / baseline (so > 1 is better for throughputs, < 1 for latencies). Targets are
minimum ratios and are reported, never asserted: these machines are too noisy for pass/fail.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from dataclasses import dataclass
from collections.abc import Iterable
from typing import Any, TextIO

import torch


@dataclass(frozen=True, slots=True)
class Figure:
    """One measured quantity, Halfmoon vs the baseline; `target` is a minimum ratio."""

    key: str
    label: str
    unit: str
    halfmoon: float
    baseline: float
    higher_is_better: bool
    target: float | None = None

    @property
    def ratio(self) -> float:
        return self.halfmoon / self.baseline

    @property
    def met(self) -> bool | None:
        return None if self.target is None else self.ratio >= self.target

    def to_json(self, baseline_name: str) -> dict[str, Any]:
        return {"label": self.label, "unit": self.unit, "halfmoon": round(self.halfmoon, 3),
                baseline_name: round(self.baseline, 3), "ratio": round(self.ratio, 4),
                "higher_is_better": self.higher_is_better, "target": self.target, "met": self.met}


def render_table(figures: list[Figure], baseline_name: str) -> str:
    """A fixed-width table: figure, both systems, ratio halfmoon/baseline, target, met/missed."""
    head = f"{'figure':<34}{'halfmoon':>11}{baseline_name:>14}{'ratio':>9}{'target':>10}  "
    return ruled(head, map(_figure_row, figures))


def _figure_row(f: Figure) -> str:
    better = "higher" if f.higher_is_better else "lower"
    target = f">={f.target:.2f}x" if f.target is not None else "-"
    verdict = {None: f"({better} is better)", True: "met", False: "MISSED"}[f.met]
    return (f"{f.label + ' (' + f.unit + ')':<34}{f.halfmoon:>11.1f}{f.baseline:>14.1f}"
            f"{f.ratio:>8.2f}x{target:>10}  {verdict}")


def ruled(head: str, rows: Iterable[str]) -> str:
    """A fixed-width table of every bench: the header, a rule as wide as it, the rows."""
    return "\n".join([head, "-" * len(head), *rows])


def cpu_model() -> str:
    """The `model name` line of /proc/cpuinfo, else whatever `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: fall back below
    return platform.processor() or platform.machine()


def machine_info(threads: int) -> dict[str, Any]:
    info: dict[str, Any] = {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": threads,
                            "torch": torch.__version__, "python": platform.python_version()}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Progress:
    """Timestamped progress lines on stderr, so stdout stays the table or the JSON."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._start = time.perf_counter()

    def __call__(self, message: str) -> None:
        elapsed = time.perf_counter() - self._start
        print(f"[bench {elapsed:7.1f}s] {message}", file=self._stream, flush=True)
