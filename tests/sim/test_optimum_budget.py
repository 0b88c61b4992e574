"""The offline optimum within a time budget (issue 45): the clock stops a search the node budget
would let run on and the result says it is a bound; without a time limit it is what the node
budget alone gives; the prefill side's fast paths (sim/optimum_bounds.py, sim/optimum_jobs.py)
equal their plain definitions float for float."""

from __future__ import annotations

import math
import random

import pytest

from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.prefill_steps import chunked_prefill_ms
from halfmoon.sim.optimum import Reference, evaluate, solve
from halfmoon.sim.optimum_bounds import Timeline, one_worker, one_worker_np, rest_bound
from halfmoon.sim.optimum_jobs import (
    MAX_HITS,
    bound_note,
    job_prefills,
    optimum_summary,
    prefill_by_hit,
)
from tests.sim.optimum_support import plan_of, random_jobs, random_reference

HARD_SEED, HARD_N = 1004, 60  # 1P1D, bursty: its exact optimum takes ~20,000 nodes (seconds)
H100 = CostModel((6.026, 0.02078, 1.515e-06, 7.573e-07), (7.481, 0.05321, 5.052e-05), 5e10, 131072, "test: H100-like")


def hard_instance() -> tuple[Reference, list]:
    rng = random.Random(HARD_SEED)
    return random_reference(rng, (1, 1)), random_jobs(rng, HARD_N, bursty=True)


def test_the_clock_stops_a_search_the_node_budget_would_let_run_and_says_it_is_a_bound() -> None:
    ref, jobs = hard_instance()
    exact = solve(ref, jobs, node_budget=10**7)
    assert exact.exact and exact.nodes > 5_000 and exact.timed_out == 0 and exact.time_budget_s == math.inf
    cut = solve(ref, jobs, node_budget=10**7, seconds=0.1)
    assert (cut.exact, cut.method, cut.inexact_segments, cut.timed_out) == (False, "upper bound", 1, 1)
    assert cut.nodes < exact.nodes  # the clock, not the node budget, stopped it
    assert cut.seconds < 1.0 and cut.time_budget_s == 0.1
    assert cut.served >= exact.served >= len(cut.schedule) > 0  # its first dive always finishes
    assert evaluate(ref, jobs, plan_of(cut.schedule, len(jobs)))
    summary = optimum_summary(cut, len(cut.schedule), 60.0, ["served"] * len(jobs), "raise --optimum-seconds")
    assert summary["bounded_by"] == {"time": 1, "nodes": 0}
    assert summary["budget"] == {"nodes": 10**7, "seconds": 0.1}
    assert "1 by the time budget (0.1 s in all)" in summary["note"] and summary["note"].endswith("raise --optimum-seconds")


@pytest.mark.parametrize("seed", range(6))
def test_no_time_at_all_still_bounds_every_segment(seed: int) -> None:
    rng = random.Random(500 + seed)
    ref = random_reference(rng, [(1, 1), (2, 1), (1, 2)][seed % 3])
    jobs = random_jobs(rng, 24, bursty=seed % 2 == 0)
    exact, none = solve(ref, jobs), solve(ref, jobs, seconds=0.0)
    assert exact.exact and not none.exact
    assert none.timed_out == none.inexact_segments == none.segments == exact.segments
    assert none.served >= exact.served and none.schedule == ()


@pytest.mark.parametrize("seed", range(6))
def test_with_a_deadline_the_window_bound_of_runs_and_their_halves_is_still_a_bound(seed: int) -> None:
    """Under a time budget `window_bound` searches runs of half its window first and counts the
    least of a run's bound and its halves': never below the optimum (test_optimum.py's instances)."""
    rng = random.Random(100 + seed)
    ref, jobs = random_reference(rng, (1, 1)), random_jobs(rng, 28, bursty=True)
    exact = solve(ref, jobs)
    cut = solve(ref, jobs, node_budget=5, window=[5, 6][seed % 2], seconds=60.0)
    assert exact.exact and cut.timed_out == 0 and cut.inexact_segments >= 1  # the window bound ran
    assert cut.served >= exact.served >= len(cut.schedule)


def test_without_a_time_limit_the_node_budget_alone_bounds_it() -> None:
    ref, jobs = hard_instance()
    cut = solve(ref, jobs, node_budget=50, window=6)
    assert cut == solve(ref, jobs, node_budget=50, window=6, seconds=math.inf)._replace(seconds=cut.seconds)
    assert (cut.exact, cut.inexact_segments, cut.timed_out, cut.node_budget) == (False, 1, 0, 50)
    assert "0 by the time budget (no time limit) and 1 by the node budget (50 nodes a segment)" in bound_note(cut)
    assert bound_note(solve(ref, jobs[:5])) is None
    with pytest.raises(ValueError, match="time budget"):
        solve(ref, jobs, seconds=-1.0)


def plain_one_worker(jobs: list, indexes: list[int], deadlines: list[float], free: float) -> int:
    """The program as first written: every count, every request."""
    finish = [free]
    for i, d in zip(indexes, deadlines, strict=True):
        for c in range(len(finish) - 1, -1, -1):
            end = max(finish[c], jobs[i].arrival_ms) + jobs[i].prefill_ms
            if end <= d:
                if c + 1 == len(finish):
                    finish.append(end)
                elif end < finish[c + 1]:
                    finish[c + 1] = end
    return len(finish) - 1


@pytest.mark.parametrize("seed", range(40))
def test_one_worker_and_rest_bound_equal_their_plain_definitions(seed: int) -> None:
    rng = random.Random(seed)
    jobs = random_jobs(rng, rng.randint(1, 90), bursty=seed % 2 == 0)
    indexes = sorted(rng.sample(range(len(jobs)), rng.randint(1, len(jobs))))
    deadlines = [jobs[i].arrival_ms + rng.uniform(500, 4000) if rng.random() > 0.1 else -math.inf for i in indexes]
    free = rng.choice([0.0, jobs[indexes[0]].arrival_ms + rng.uniform(-200, 2000)])
    plain = plain_one_worker(jobs, indexes, deadlines, free)
    assert one_worker(jobs, indexes, deadlines, free) == one_worker_np(jobs, indexes, deadlines, free) == plain
    frees = (free, free + rng.uniform(0, 900))
    k = rng.randrange(len(indexes))
    fits = Timeline(jobs, indexes, deadlines).fits(k, min(frees))
    alone = sum(max(min(frees), jobs[i].arrival_ms) + jobs[i].prefill_ms <= d for i, d in zip(indexes[k:], deadlines[k:]))
    assert int(fits.sum()) == alone
    assert rest_bound(jobs, indexes[k:], deadlines[k:], frees, fits=fits) == rest_bound(jobs, indexes[k:], deadlines[k:], frees)


@pytest.mark.parametrize("seed", range(20))
def test_prefill_by_hit_is_chunked_prefill_float_for_float(seed: int) -> None:
    rng = random.Random(seed)
    prompt, chunk = rng.randint(1, 20_000), rng.choice([None, 256, 512, 2048])
    hits = {rng.choice([rng.randrange(0, prompt + 600, 512), rng.randrange(0, prompt + 600, 16)]) for _ in range(12)}
    by_hit = prefill_by_hit(H100, prompt, hits, chunk)
    assert set(by_hit) == {h for h in hits if 0 <= h < prompt}
    for h, ms in by_hit.items():
        assert ms == (H100.est_prefill_ms(prompt - h, h) if chunk is None else chunked_prefill_ms(H100, prompt - h, h, chunk))


@pytest.mark.parametrize("n_hits", [0, 3, MAX_HITS + 1])
def test_job_prefills_is_the_best_over_each_hit(n_hits: int) -> None:
    rng = random.Random(n_hits)
    prompt, given = 9000, {1024, 4096}
    hits = {j: rng.randrange(0, 9000, 512) for j in range(n_hits)}

    def best(reusable: set[int]) -> float:
        return min(chunked_prefill_ms(H100, prompt - h, h, 512) for h in {0, *reusable} if h < prompt)

    got_best, cold, options = job_prefills(H100, prompt, given, hits, 512)
    if n_hits > MAX_HITS:
        assert (got_best, cold, options) == (best(given | set(hits.values())), None, ())
        return
    expect = {j: best(given | {h}) for j, h in hits.items()}
    assert options == tuple(sorted(((j, ms) for j, ms in expect.items() if ms < best(given)), key=lambda o: (o[1], o[0])))
    assert got_best == min([best(given), *expect.values()])
    assert cold == (best(given) if options else None)
