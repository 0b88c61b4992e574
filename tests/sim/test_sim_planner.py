"""The planner in the simulator (sim/planned.py): off is the plain replay; act moves the split
toward each phase's pool and beats every static split on a trace whose mix shifts; nothing is
lost on the way (every request ends, every ledger and cache checks out); advise changes nothing;
a move that made things worse is rolled back on the simulated workers."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest

from halfmoon.conductor.planner import PlannerConfig, Split
from halfmoon.sim import builtin
from halfmoon.sim.cluster import SimConfig, simulate
from halfmoon.sim.phases import parse_phases, phased_trace
from halfmoon.sim.planned import PlannedSimulator, simulate_planned
from halfmoon.sim.planned_report import goodput_between, planned_summary, render_planned
from halfmoon.sim.trace import parse_line
from halfmoon.sim.workload import Workload, build

START = Split(2, 2)
DAY_BEST = Split(1, 3)  # the best static split of `shifting()`: where the planner starts
# a tick every 3 s on the last 12 s (a decode-bound window must span a few requests: ~4 s each); a move
# the first tick it is advised
PLAN = PlannerConfig(mode="act", interval_s=3.0, window_s=12.0, confirm=1, judge_s=6.0, cooldown_s=30.0)


def shifting(spec: str = "prefill:30,decode:30,prefill:30", scale: float = 0.5) -> Workload:
    """Long documents, chat with long answers, documents again (sim/phases.py's presets at half
    the rate they load 8 H100s with: four workers). Over the whole day 1P3D serves best of the
    static splits (chat has three times the requests); documents want 3P1D."""
    rows = phased_trace(parse_phases(spec, scale), seed=3)
    return build([parse_line(json.dumps(r), n) for n, r in enumerate(rows, start=1)], source=spec)


@pytest.fixture(scope="module")
def cost():
    return builtin.load("llama3-8b-h100")


@pytest.fixture(scope="module")
def day() -> Workload:
    return shifting()


@pytest.fixture(scope="module")
def acted(day, cost):
    return simulate_planned(day, config(DAY_BEST), cost, PLAN, start_s=5.0)


def config(split: Split) -> SimConfig:
    return SimConfig(prefill=split.prefill, decode=split.decode)


def test_off_is_the_plain_replay(cost) -> None:
    workload = shifting("prefill:6,decode:6")
    plain = simulate(workload, config(START), cost)
    off = simulate_planned(workload, config(START), cost, dataclasses.replace(PLAN, mode="off"))
    assert off.result.records == plain.records
    assert off.decisions == () and off.splits == ((0.0, START),) and off.moves == ()


def test_act_follows_the_mix_and_beats_every_static_split(day, cost, acted) -> None:
    end = day.duration_s
    planner = goodput_between(acted.result, 0.0, end)
    statics = {s: goodput_between(simulate(day, config(s), cost), 0.0, end) for s in (DAY_BEST, START, Split(3, 1))}
    assert max(statics, key=statics.__getitem__) == DAY_BEST
    assert planner > statics[DAY_BEST], (planner, statics, render_planned(acted, "act"))
    split_at = dict(acted.splits)
    assert max(s.prefill for t, s in split_at.items() if t < 30.0) == 3, acted.splits  # documents: 3P1D
    assert min(s.prefill for t, s in split_at.items() if 30.0 <= t < 60.0) == 1, acted.splits  # chat: 1P3D
    assert max(s.prefill for t, s in split_at.items() if t >= 60.0) == 3, acted.splits  # documents again
    flips = [d for d in acted.decisions if d.action == "flip"]
    assert flips and all(d.applied for d in flips)
    assert {d.role for d in flips} == {"prefill", "decode"}  # both ways: the phases' pools


def test_nothing_is_lost_on_the_way(day, acted) -> None:
    statuses = Counter(r.status for r in acted.result.records)
    assert sum(statuses.values()) == len(day.requests)
    assert set(statuses) <= {"ok", "rejected", "timeout"}, statuses
    assert all(m.done_at is not None and m.done_at >= m.at for m in acted.moves)
    assert acted.final_split.total == DAY_BEST.total
    # a worker that drained changed pool under its own id (a fresh worker, its busy time kept)
    moved = {m.worker for m in acted.moves}
    assert moved and moved <= set(acted.result.busy_s)
    summary = planned_summary(acted)
    assert summary["moves"] == len(acted.moves) and summary["final_split"] == str(acted.final_split)


def test_advise_changes_nothing_but_says_what_it_would_do(cost) -> None:
    workload = shifting("prefill:15,decode:5")
    plain = simulate(workload, config(START), cost)
    advised = simulate_planned(workload, config(START), cost, dataclasses.replace(PLAN, mode="advise"))
    assert advised.result.records == plain.records
    assert advised.splits == ((0.0, START),) and advised.moves == ()
    assert any(d.moves for d in advised.decisions) and not any(d.applied for d in advised.decisions)


class Regret:
    """A scripted advisor: any tick's best is `bad`; judging a move (two splits), the split
    before it serves as well (the rule then rolls the move back)."""

    def __init__(self, bad: Split) -> None:
        self.bad = bad

    def score(self, window, window_s, splits):
        if len(splits) == 2:
            return dict.fromkeys(splits, 1.0)
        return {s: (10.0 if s == self.bad else 1.0) for s in splits}


def test_a_bad_move_is_rolled_back_on_the_simulated_workers(cost) -> None:
    """Decode-heavy traffic, a move to 3P1D forced: attainment falls, the move is undone."""
    workload = shifting("decode:40", 0.5)
    plan = dataclasses.replace(PLAN, cooldown_s=60.0)
    simulator = PlannedSimulator(config(START), cost, plan, Regret(Split(3, 1)))
    planned = simulator.run_planned(workload)
    actions = [d.action for d in planned.decisions if d.moves]
    assert actions[:2] == ["flip", "rollback"], [d.reason for d in planned.decisions]
    rollback = next(d for d in planned.decisions if d.action == "rollback")
    assert rollback.applied and rollback.next_split == START
    whole = [s for _, s in planned.splits if s.total == START.total]  # a draining worker counts in neither pool
    assert whole[:3] == [START, Split(3, 1), START]
    assert any("rolled back" in d.reason for d in planned.decisions if d.action == "hold")


def test_phases_make_a_shifting_mooncake_trace(tmp_path) -> None:
    from halfmoon.bench.make_trace import main as make_trace
    from halfmoon.sim.phases import boundaries

    phases = parse_phases("prefill:10,decode:10:5", scale=2.0)
    assert [(p.name, p.rate) for p in phases] == [("prefill", 40.0), ("decode", 10.0)]
    assert boundaries(phases) == [("prefill", 0.0, 10.0), ("decode", 10.0, 20.0)]
    rows = phased_trace(phases, seed=1)
    assert rows == phased_trace(phases, seed=1) and rows == sorted(rows, key=lambda r: r["timestamp"])
    early = [r for r in rows if r["timestamp"] < 10_000]
    assert early and all(r["input_length"] >= 6000 for r in early)
    assert all(r["input_length"] <= 300 for r in rows if r["timestamp"] >= 10_000)
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 512) for r in rows)
    json_spec = '[{"name": "x", "duration_s": 2, "rate": 3, "input_tokens": [5, 9], "output_tokens": [1, 2]}]'
    assert parse_phases(json_spec)[0].input_tokens == (5, 9)
    with pytest.raises(ValueError, match="NAME:SECONDS"):
        parse_phases("lunch:10")
    out = tmp_path / "day.jsonl"
    assert make_trace(["--phases", "prefill:3,decode:3", "--phase-scale", "0.5", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) > 10


def test_sim_cli_runs_the_planner(tmp_path, capsys) -> None:
    from halfmoon.cli.main import main

    trace = tmp_path / "day.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in phased_trace(parse_phases("prefill:12,decode:12", 0.5), 1)))
    args = ["sim", "--trace", str(trace), "--profile", "llama3-8b-h100", "--prefill", "1", "--decode", "3",
            "--device-tokens", "65536", "--chunk", "8192", "--planner", "act", "--planner-interval-s", "3",
            "--planner-window-s", "12", "--planner-confirm", "1", "--optimum-nodes", "0", "--no-progress",
            "--out", str(tmp_path)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "planner (act):" in text and "halfmoon sim: 1P3D" in text and "flip prefill 1P3D -> 2P2D" in text
    summary = json.loads((tmp_path / "sim.json").read_text())
    assert summary["planner"]["moves"] >= 1 and summary["planner"]["decisions"]
    assert (tmp_path / "splits.png").stat().st_size > 0


def test_the_planner_bench_runs_quick(tmp_path, capsys) -> None:
    from halfmoon.bench.planner_sim import main as bench

    assert bench(["--quick", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "best static" in text and "oracle per phase" in text and "x the oracle" in text
    summary = json.loads((tmp_path / "planner_sim.json").read_text())
    assert set(summary["goodput_rps"]) == {"static", "oracle", "planner"}
    assert (tmp_path / "planner_sim.png").stat().st_size > 0


class Wants:
    """A scripted advisor: `best` scores best whatever the window."""

    def __init__(self, best: Split) -> None:
        self.best = best

    def score(self, window, window_s, splits):
        return {s: (10.0 if s == self.best else 1.0) for s in splits}


def test_an_added_worker_serves_after_its_start_and_a_removed_one_drains_first(cost) -> None:
    workload = shifting("decode:20", 0.5)
    grow = dataclasses.replace(PLAN, max_workers=5)
    added = PlannedSimulator(config(START), cost, grow, Wants(Split(2, 3)), start_s=5.0).run_planned(workload)
    first = added.moves[0]
    assert (first.action, first.role, first.worker) == ("add", "decode", "decode-4")
    assert first.done_at == pytest.approx(first.at + 5.0)  # not routed before it started
    assert added.splits[:2] == ((0.0, START), (first.done_at, Split(2, 3)))
    assert "decode-4" in added.result.busy_s
    shrink = dataclasses.replace(PLAN, min_workers=3)
    removed = PlannedSimulator(config(START), cost, shrink, Wants(Split(1, 2))).run_planned(workload)
    (move,) = removed.moves
    assert (move.action, move.role) == ("remove", "prefill") and removed.final_split == Split(1, 2)
    assert move.done_at >= move.at and move.worker in removed.result.busy_s  # drained, its busy time kept
    statuses = Counter(r.status for r in removed.result.records)
    assert sum(statuses.values()) == len(workload.requests) and set(statuses) <= {"ok", "rejected"}
