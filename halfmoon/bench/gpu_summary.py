"""The one JSON summary of a deploy/gpu_check.sh run, to quote in docs/BENCHMARKS.md.

    python -m halfmoon.bench.gpu_summary OUT_DIR      # writes OUT_DIR/gpu_summary.json, prints it

Reads what the phases left in OUT_DIR: `phases.tsv` (one line per phase: name, budget s,
seconds taken, exit code, as the script wrote them), `junit-<phase>.xml` (pytest's counts),
`serve.json` (phase b, bench/gpu_serve_check.py), `bench_engine_cuda.json` and
`transport_cuda.json` (phase c). A phase whose file is missing is reported as such, never
guessed.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def read_phases(out: Path) -> list[dict[str, Any]]:
    rows = []
    path = out / "phases.tsv"
    for line in path.read_text().splitlines() if path.is_file() else []:
        name, budget, took, code = line.split("\t")
        rows.append({"phase": name, "budget_s": int(budget), "seconds": int(took), "exit": int(code),
                     "status": "skipped" if code == "-1" else ("ok" if code == "0" else "failed")})
    return rows


def junit_counts(path: Path) -> dict[str, int] | None:
    """pytest's tests / failures / errors / skipped of one JUnit file (None: no file)."""
    if not path.is_file():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def _json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def engine_figures(report: dict[str, Any] | None) -> dict[str, Any] | None:
    """Per system, W1/W2/W3 ratios to transformers and whether the targets were met."""
    if report is None:
        return None
    out: dict[str, Any] = {"gpu": report.get("machine", {}).get("gpu"), "targets_met": report.get("targets_met")}
    for name, sec in report.get("systems", {}).items():
        out[name] = {k: {"halfmoon": f["halfmoon"], "transformers": f["transformers"], "ratio": f["ratio"],
                         "target": f["target"], "met": f["met"]} for k, f in sec["figures"].items()}
        out[name]["graph_replays"] = sec.get("graph_replays")
    return out


def transfer_figures(report: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """Per prompt length: the path its units took and the share of the transfer hidden."""
    if report is None:
        return None
    return [{"tokens": r["tokens"], "path": r.get("path"), "hidden": round(r["hidden"], 3),
             "transfer_ms": round(r["transfer_ms"], 1), "exposed_ms": round(r["exposed_ms"], 1)}
            for r in report.get("pipelining", [])]


def summarize(out: Path) -> dict[str, Any]:
    phases = read_phases(out)
    for row in phases:
        row["tests"] = junit_counts(out / f"junit-{row['phase']}.xml")
    serve = _json(out / "serve.json")
    cold = _json(out / "cold_start.json")
    return {
        "phases": phases,
        "cold_start": cold,
        "total_seconds": sum(r["seconds"] for r in phases),
        "serve_1p1d": None if serve is None else {k: serve[k] for k in ("ok", "identical", "prompts",
                                                                        "kv_bytes_by_path", "ready_s")},
        "engine_vs_transformers": engine_figures(_json(out / "bench_engine_cuda.json")),
        "kv_transfer": transfer_figures(_json(out / "transport_cuda.json")),
        "ok": bool(phases) and all(r["status"] == "ok" for r in phases),
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m halfmoon.bench.gpu_summary OUT_DIR", file=sys.stderr)
        return 2
    out = Path(args[0])
    summary = summarize(out)
    (out / "gpu_summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
