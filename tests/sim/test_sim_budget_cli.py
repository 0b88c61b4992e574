"""`halfmoon sim` at its defaults answers within its time budget (issue 45): on a trace whose exact
optimum takes far longer it reports an upper bound, says the time budget made it one and how to
get the exact figure; its progress bar goes to stderr only when the search runs long; `halfmoon
bench sim --cli` times the command."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from halfmoon.bench.make_trace import parse_args as make_trace_args
from halfmoon.bench.sim_bench import CLI_TARGET_S, cli_run, render_cli
from halfmoon.cli.main import main
from halfmoon.cli.sim import DEFAULT_OPTIMUM_SECONDS
from halfmoon.sim.conversations import conversation_trace, write_trace
from tests.sim.support import sample_trace

SHAPE = ["--prefill", "1", "--decode", "1", "--profile", "llama3-8b-h100"]


@pytest.fixture(scope="module")
def busy_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3,000 chat requests, 2 sessions starting a second: an overloaded 1P1D whose exact optimum
    takes minutes (its segments run to hundreds of requests), the replay itself about a second."""
    args = make_trace_args(["--requests", "3000", "--seed", "3", "--sessions-per-s", "2"])
    return write_trace(conversation_trace(args.requests, args.seed, args.shape),
                       tmp_path_factory.mktemp("busy") / "busy.jsonl")


def test_sim_at_its_defaults_answers_within_its_time_budget(busy_trace: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    start = time.perf_counter()
    assert main(["sim", "--trace", str(busy_trace), *SHAPE, "--json"]) == 0
    wall = time.perf_counter() - start
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # stdout: the JSON alone
    o = report["optimum"]
    assert o["budget"] == {"nodes": 100_000, "seconds": DEFAULT_OPTIMUM_SECONDS}
    assert o["search_s"] <= DEFAULT_OPTIMUM_SECONDS + 0.5
    assert wall < report["wall_s"] + DEFAULT_OPTIMUM_SECONDS + 3.0  # the replay, the budget, the rest
    assert o["method"] == "upper bound" and o["served"] >= o["best_schedule"] > 0
    assert o["bounded_by"]["time"] >= 1 and o["inexact_segments"] == sum(o["bounded_by"].values())
    assert "by the time budget (3 s in all)" in o["note"] and "raise --optimum-seconds" in o["note"]
    assert "offline optimum" in captured.err  # it ran past a second: the bar showed, on stderr


def test_the_text_report_says_the_time_budget_bounded_it(busy_trace: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--trace", str(busy_trace), *SHAPE, "--optimum-seconds", "0.3", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "offline optimum:" in captured.out and "(upper bound; a schedule found serves" in captured.out
    assert "by the time budget (0.3 s in all)" in captured.out and "raise --optimum-seconds" in captured.out
    assert captured.err == ""


def test_a_quick_optimum_is_exact_and_shows_no_bar(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--trace", str(sample_trace()), *SHAPE, "--json"]) == 0
    captured = capsys.readouterr()
    o = json.loads(captured.out)["optimum"]
    assert (o["method"], o["note"], o["bounded_by"]) == ("exact", None, {"time": 0, "nodes": 0})
    assert "offline optimum" not in captured.err


def test_optimum_seconds_must_not_be_negative(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--trace", str(sample_trace()), *SHAPE, "--optimum-seconds", "-1", "--no-progress"]) == 2
    assert "--optimum-seconds takes seconds >= 0" in capsys.readouterr().err


def test_bench_sim_cli_times_the_command_at_its_defaults() -> None:
    row = cli_run(None, quick=True)
    assert row["requests"] == 1203 and row["trace"].startswith("synthetic: make-trace --requests 1203")
    assert row["target_s"] == CLI_TARGET_S and row["seconds"] > row["replay_s"] > 0
    assert row["optimum"]["budget"] == {"nodes": 100_000, "seconds": DEFAULT_OPTIMUM_SECONDS}
    text = render_cli(row)
    assert f"target < {CLI_TARGET_S:g} s" in text and "offline optimum:" in text
