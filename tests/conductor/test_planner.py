"""The planner's decisions (conductor/planner.py) with the simulator's advisor (sim/advisor.py):
moves toward the split the window needs, one step a tick, confirmed first; holds on a noisy
steady load; rolls a move back when what came after did worse."""

from __future__ import annotations

import random

import pytest

from halfmoon.conductor.planner import (Decision, Planner, PlannerConfig, Seen, Split, Traffic, attainment,
                                        best_split, candidates, step_toward)
from halfmoon.core.errors import ConfigError
from halfmoon.sim import builtin
from halfmoon.sim.advisor import SimAdvisor, window_workload
from halfmoon.sim.cluster import SimConfig

WINDOW_S = 60.0


def mix(kind: str, rng: random.Random, start: float, rate: float | None = None, span: float = WINDOW_S) -> list[Seen]:
    """Poisson arrivals over [start, start + span): long prompts / short outputs ("prefill")
    or short prompts / long outputs ("decode"); the default rates load 8 H100s of Llama 3 8B
    so that the split matters."""
    out, t = [], start
    rate = rate or (20.0 if kind == "prefill" else 60.0)
    while (t := t + rng.expovariate(rate)) < start + span:
        if kind == "prefill":
            out.append(Seen(t, rng.randint(6000, 8000), rng.randint(10, 30)))
        else:
            out.append(Seen(t, rng.randint(100, 300), rng.randint(300, 600)))
    return out


@pytest.fixture(scope="module")
def advisor() -> SimAdvisor:
    return SimAdvisor(SimConfig(), builtin.load("llama3-8b-h100"))


def planner(advisor, start: Split = Split(4, 4)) -> Planner:
    config = PlannerConfig(mode="act", interval_s=WINDOW_S, window_s=WINDOW_S, judge_s=WINDOW_S)
    return Planner(config.bounded(start), advisor)


def test_bounds_list_the_splits_and_refuse_nonsense() -> None:
    assert PlannerConfig().bounded(Split(2, 2)).splits() == [Split(1, 3), Split(2, 2), Split(3, 1)]
    wider = PlannerConfig(max_workers=5, max_prefill=2).bounded(Split(2, 2)).splits()
    assert Split(2, 3) in wider and Split(3, 2) not in wider and Split(1, 1) not in wider
    with pytest.raises(ConfigError, match="planner mode"):
        PlannerConfig(mode="auto")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="decode pool"):
        PlannerConfig(min_decode=3, max_decode=2)
    with pytest.raises(ConfigError, match="confirm"):
        PlannerConfig(confirm=0)


def test_a_step_is_one_flip_or_one_worker() -> None:
    assert step_toward(Split(4, 4), Split(6, 2)) == ("flip", "prefill")
    assert step_toward(Split(4, 4), Split(4, 6)) == ("add", "decode")
    assert step_toward(Split(4, 4), Split(3, 4)) == ("remove", "prefill")
    flip = Decision(0.0, "flip", Split(4, 4), Split(6, 2), "", "prefill")
    assert flip.next_split == Split(5, 3)
    assert Decision(0.0, "rollback", Split(5, 3), Split(4, 4), "", "decode").next_split == Split(4, 4)
    assert Decision(0.0, "add", Split(4, 4), Split(4, 6), "", "decode").next_split == Split(4, 5)
    assert Decision(0.0, "hold", Split(4, 4), Split(4, 4), "").next_split == Split(4, 4)


def test_ties_prefer_fewer_workers_then_the_split_now() -> None:
    scores = {Split(1, 3): 5.0, Split(2, 2): 5.02, Split(3, 1): 1.0}
    assert best_split(scores, Split(1, 3)) == Split(1, 3)
    assert best_split(scores, Split(3, 1)) == Split(1, 3)
    assert best_split({Split(1, 1): 5.0, Split(2, 2): 5.0}, Split(2, 2)) == Split(1, 1)


def test_many_splits_are_thinned_around_the_current_one() -> None:
    splits = PlannerConfig().bounded(Split(32, 32)).splits()
    picked = candidates(splits, Split(32, 32))
    assert len(splits) == 63 and len(picked) <= 30
    assert {Split(30, 34), Split(31, 33), Split(32, 32), Split(33, 31), Split(34, 30)} <= set(picked)
    assert picked[0].prefill <= 3 and picked[-1].prefill >= 60


def test_the_window_replays_arrivals_in_order(advisor: SimAdvisor) -> None:
    rng = random.Random(1)
    seen = mix("decode", rng, 100.0)
    workload = window_workload(seen, WINDOW_S)
    assert len(workload.requests) == len(seen)
    arrivals = [r.arrival_s for r in workload.requests]
    assert arrivals == sorted(arrivals) and 0.0 <= arrivals[0] and arrivals[-1] <= WINDOW_S + 1e-9
    assert len({b for r in workload.requests for b in r.blocks}) == sum(len(r.blocks) for r in workload.requests)


def test_a_prefill_heavy_window_moves_toward_prefill_one_step_after_confirming(advisor: SimAdvisor) -> None:
    rng = random.Random(2)
    plan = planner(advisor)
    first = plan.tick(WINDOW_S, Split(4, 4), mix("prefill", rng, 0.0))
    assert first.action == "hold" and "1 of 2" in first.reason and first.waiting
    assert first.target.prefill > 4 and first.scores[str(first.target)] > first.scores["4P4D"]
    second = plan.tick(2 * WINDOW_S, Split(4, 4), mix("prefill", rng, WINDOW_S))
    assert second.action == "flip" and second.role == "prefill" and second.next_split == Split(5, 3)
    assert second.gain >= 0.10 and "goodput over 4P4D" in second.reason


def test_a_noisy_steady_load_does_not_flap(advisor: SimAdvisor) -> None:
    """Eight ticks of one steady mix (Poisson noise in every window) on four workers: the planner
    settles on a split and never goes back and forth."""
    rng = random.Random(3)
    plan, split, moves = planner(advisor, Split(2, 2)), Split(2, 2), []
    for tick in range(8):
        window = mix("decode", rng, tick * WINDOW_S, rate=25.0) + mix("prefill", rng, tick * WINDOW_S, rate=10.0)
        decision = plan.tick((tick + 1) * WINDOW_S, split, window)
        assert min(decision.scores.values()) < 0.8 * max(decision.scores.values()), "a load where the split matters"
        if decision.moves:
            moves.append(decision)
            split = decision.next_split
    directions = [m.role for m in moves if m.action == "flip"]
    assert len(moves) <= 2, [m.reason for m in moves]
    assert len(set(directions)) <= 1, "flipped one way, then back"


class Scripted:
    """An advisor whose scores a test sets (a stand-in for the simulator: the rollback rule
    judges what was measured and what the advisor says of the traffic since the move)."""

    def __init__(self, best: Split) -> None:
        self.best = best

    def score(self, window, window_s, splits):
        return {s: (10.0 if s == self.best else 1.0) for s in splits}


def test_a_move_that_made_things_worse_is_rolled_back_and_kept_out() -> None:
    advisor = Scripted(Split(3, 1))
    plan = Planner(PlannerConfig(mode="act", confirm=1, judge_s=30.0, cooldown_s=600.0).bounded(Split(2, 2)),
                   advisor)
    before = [Seen(t, 100, 100, met=True) for t in range(0, 60, 2)]
    move = plan.tick(60.0, Split(2, 2), before)
    assert move.action == "flip" and move.next_split == Split(3, 1)
    after = before + [Seen(60.0 + t, 100, 100, met=t % 3 == 0) for t in range(0, 30, 2)]
    advisor.best = Split(2, 2)  # replayed, the traffic since the move is served better by the old split
    back = plan.tick(91.0, Split(3, 1), after)
    assert back.action == "rollback" and back.next_split == Split(2, 2) and back.role == "decode"
    assert "fell to" in back.reason and back.scores == {"2P2D": 10.0, "3P1D": 1.0}
    advisor.best = Split(3, 1)  # advised again: it stays out
    again = plan.tick(120.0, Split(2, 2), after)
    assert again.action == "hold" and "rolled back" in again.reason and not again.waiting


def test_a_move_is_not_undone_by_advice_before_it_is_judged() -> None:
    """Live (issue 49, confirm 1): a flip to 1P3D at one tick, the flip back the next, 10 s later.
    The move's reverse waits for its judgement; another direction does not."""
    advisor = Scripted(Split(1, 3))
    plan = Planner(PlannerConfig(mode="act", confirm=1, judge_s=30.0, min_gain=0.1).bounded(Split(2, 2)), advisor)
    window = [Seen(t, 100, 100, met=True) for t in range(0, 60, 2)]
    assert plan.tick(60.0, Split(2, 2), window).next_split == Split(1, 3)
    advisor.best = Split(2, 2)
    held = plan.tick(70.0, Split(1, 3), window)
    assert held.action == "hold" and "would undo 2P2D -> 1P3D" in held.reason
    assert plan.tick(91.0, Split(1, 3), window).next_split == Split(2, 2)  # judged (it held up): advice moves


def test_a_fall_the_traffic_explains_is_no_reason_to_roll_back() -> None:
    """Attainment fell after the move, but the mix shifted: replayed, the traffic since is still
    served better by the new split."""
    plan = Planner(PlannerConfig(mode="act", confirm=1, judge_s=30.0).bounded(Split(2, 2)), Scripted(Split(3, 1)))
    before = [Seen(t, 100, 100, met=True) for t in range(0, 60, 2)]
    assert plan.tick(60.0, Split(2, 2), before).action == "flip"
    after = before + [Seen(60.0 + t, 100, 100, met=False) for t in range(0, 30, 2)]
    assert plan.tick(91.0, Split(3, 1), after).action == "hold"


def test_a_move_that_held_up_stays() -> None:
    plan = Planner(PlannerConfig(mode="act", confirm=1, judge_s=30.0).bounded(Split(2, 2)), Scripted(Split(3, 1)))
    window = [Seen(t, 100, 100, met=True) for t in range(0, 100, 2)]
    assert plan.tick(60.0, Split(2, 2), window).action == "flip"
    assert plan.tick(91.0, Split(3, 1), window).action == "hold"


def test_advise_mode_never_judges_a_move_it_did_not_make() -> None:
    plan = Planner(PlannerConfig(confirm=1, judge_s=30.0).bounded(Split(2, 2)), Scripted(Split(3, 1)))
    assert plan.tick(60.0, Split(2, 2), [Seen(1.0, 10, 10, met=True)]).action == "flip"
    worse = [Seen(70.0, 10, 10, met=False)]
    assert plan.tick(91.0, Split(2, 2), worse).action == "flip"  # advised again, nothing rolled back


def test_traffic_keeps_the_window_and_learns_how_requests_ended() -> None:
    traffic = Traffic(keep_s=100.0)
    traffic.arrived("a", 1.0, 50, 200)
    traffic.arrived("b", 50.0, 60, 100)
    traffic.ended("a", 17, met=True)
    traffic.ended("b", 0, met=False, rejected=True)
    window = traffic.window(60.0, 60.0)
    assert [(s.output_len, s.met, s.rejected) for s in window] == [(17, True, False), (100, False, True)]
    assert attainment(window) == 0.5
    traffic.arrived("c", 200.0, 5, 5)
    assert [s.prompt_len for s in traffic.window(200.0, 60.0)] == [5]
