"""bench/gpu_summary.py: the GPU run's one JSON summary, from the files the phases leave."""

from __future__ import annotations

import json
from pathlib import Path

from halfmoon.bench.gpu_summary import main, summarize

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"
failures="1" skipped="2" tests="10" time="3.0"></testsuite></testsuites>"""


def fig(hm: float, hf: float, target: float | None) -> dict:
    ratio = hm / hf
    return {"halfmoon": hm, "transformers": hf, "ratio": ratio, "target": target,
            "met": None if target is None else ratio >= target, "label": "x", "unit": "tok/s"}


def test_summary_collects_every_phase(tmp_path: Path) -> None:
    (tmp_path / "phases.tsv").write_text("a1\t92\t80\t0\na2\t50\t50\t124\nb\t81\t40\t0\nd\t20\t0\t-1\n")
    (tmp_path / "junit-a1.xml").write_text(JUNIT)
    (tmp_path / "serve.json").write_text(json.dumps({"ok": True, "identical": 4, "prompts": 4, "ready_s": 30.5,
                                                     "kv_bytes_by_path": {"staged": 1e6, "host": 0.0}}))
    (tmp_path / "bench_engine_cuda.json").write_text(json.dumps({
        "machine": {"gpu": "H100"}, "targets_met": False,
        "systems": {"halfmoon graphs": {"figures": {"w1_tok_s": fig(300, 100, 3.0), "w2_tok_s": fig(500, 250, 3.0)},
                                        "graph_replays": 120}}}))
    (tmp_path / "transport_cuda.json").write_text(json.dumps({"pipelining": [
        {"tokens": 2048, "path": "staged", "hidden": 0.8766, "transfer_ms": 10.04, "exposed_ms": 1.24}]}))
    s = summarize(tmp_path)
    assert [(p["phase"], p["status"]) for p in s["phases"]] == [("a1", "ok"), ("a2", "failed"), ("b", "ok"),
                                                                ("d", "skipped")]
    assert s["phases"][0]["tests"] == {"tests": 10, "failures": 1, "errors": 0, "skipped": 2, "passed": 7}
    assert s["phases"][1]["tests"] is None  # no JUnit file: reported as missing, not guessed
    assert s["total_seconds"] == 170 and s["ok"] is False
    assert s["serve_1p1d"]["identical"] == 4 and s["serve_1p1d"]["kv_bytes_by_path"]["staged"] == 1e6
    graphs = s["engine_vs_transformers"]["halfmoon graphs"]
    assert graphs["w1_tok_s"]["met"] is True and graphs["w2_tok_s"]["met"] is False
    assert s["kv_transfer"] == [{"tokens": 2048, "path": "staged", "hidden": 0.877, "transfer_ms": 10.0,
                                 "exposed_ms": 1.2}]
    assert s["cold_start"] is None


def test_main_writes_the_summary_file(tmp_path: Path) -> None:
    (tmp_path / "phases.tsv").write_text("a1\t92\t80\t0\n")
    assert main([str(tmp_path)]) == 0
    written = json.loads((tmp_path / "gpu_summary.json").read_text())
    assert written["ok"] is True and written["engine_vs_transformers"] is None


def test_serve_check_fails_loudly_when_serve_cannot_run(tmp_path: Path) -> None:
    from halfmoon.bench import gpu_serve_check

    assert gpu_serve_check.missing_modules(("json", "no_such_module_xyz")) == ["no_such_module_xyz"]
    text = "halfmoon_worker_kv_received_path_bytes_total{path=\"staged\",worker=\"decode-0\"} 4096.0\n"
    text += "halfmoon_worker_kv_received_path_bytes_total{path=\"host\",worker=\"decode-0\"} 0.0\n"
    assert gpu_serve_check.path_bytes(text) == {"staged": 4096.0, "host": 0.0}
