"""The offline optimum (sim/optimum.py): exact against brute force on small instances, bursty ones
included; an upper bound out of budget; never lower with more workers; its load profile against
the model's definition token by token; a hand-checked instance."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from halfmoon.sim.optimum import Job, Load, Reference, evaluate, segments, servable_alone, solve, stay, step_at, tbts_ms
from tests.sim.optimum_support import CPU, FLAT, plan_of, random_jobs, random_reference

def brute_force(ref: Reference, jobs: list[Job]) -> int:
    """Every plan (refuse, or a prefill and a decode worker per request; with prefix hits also
    a prefill only, warming the cache), checked whole."""
    warm = any(job.hits for job in jobs)
    options = [None, *itertools.product(range(ref.prefill), range(-1 if warm else 0, ref.decode))]
    best = 0
    for plan in itertools.product(options, repeat=len(jobs)):
        served = sum(p is not None and p[1] >= 0 for p in plan)
        if served > best and evaluate(ref, jobs, plan):
            best = served
    return best


@pytest.mark.parametrize("seed", range(24))
def test_exact_optimum_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    shape = [(1, 1), (2, 1), (1, 2), (2, 2)][seed % 4]
    n = {1: 9, 2: 6, 4: 5}[shape[0] * shape[1]]
    ref, jobs = random_reference(rng, shape), random_jobs(rng, n, bursty=seed % 2 == 0)
    optimum = solve(ref, jobs)
    assert optimum.exact
    assert optimum.served == brute_force(ref, jobs)
    assert len(optimum.schedule) == optimum.served
    assert evaluate(ref, jobs, plan_of(optimum.schedule, n))  # the schedule it reports is one


def with_hits(rng: random.Random, jobs: list[Job]) -> list[Job]:
    """Some requests share a prefix with an earlier one: cheaper only if that one is admitted."""
    out = []
    for i, job in enumerate(jobs):
        if i and rng.random() < 0.6:
            hits = tuple(sorted(((j, job.prefill_ms * rng.uniform(0.1, 0.7)) for j in rng.sample(range(i), min(i, 2))),
                                key=lambda h: h[1]))
            job = replace(job, prefill_ms=hits[0][1], cold_ms=job.prefill_ms, hits=hits)
        out.append(job)
    return out


@pytest.mark.parametrize("seed", range(16))
def test_prefix_hits_only_from_admitted_requests_exact_against_brute_force(seed: int) -> None:
    """A request's prefill is cheaper only when an earlier one sharing its prefix was admitted
    (`Job.hits`): the search (linked segments searched as one) agrees with every plan checked."""
    rng = random.Random(300 + seed)
    shape = [(1, 1), (2, 1)][seed % 2]
    n = {1: 8, 2: 6}[shape[0] * shape[1]]
    ref, jobs = random_reference(rng, shape), with_hits(rng, random_jobs(rng, n, bursty=seed % 4 < 2))
    optimum = solve(ref, jobs)
    assert optimum.exact and optimum.served == brute_force(ref, jobs)
    assert evaluate(ref, jobs, plan_of(optimum.schedule, n, optimum.warmed))


def test_a_hit_counts_only_if_its_holder_is_admitted() -> None:
    """B fits its 1 s TTFT only on A's prefix (cold 1500 ms, 300 with the hit); A fits alone:
    both served. An A that cannot be served may still be prefilled for B (a warmer)."""
    ref = Reference(1, 1, 1000.0, 100.0, FLAT)
    a = Job(0.0, 100, 2, 500.0)
    b = Job(2000.0, 100, 2, 300.0, cold_ms=1500.0, hits=((0, 300.0),))
    assert solve(ref, [a, b]).served == 2
    assert b.prefill_given(lambda j: False) == 1500.0 and b.prefill_given(lambda j: j == 0) == 300.0
    # A misses even alone (prefill 1500 ms), yet prefilling it warms B's prefix: B is served
    slow_a = replace(a, prefill_ms=1500.0)
    warm = solve(ref, [slow_a, b])
    assert (warm.served, [p.job for p in warm.warmed]) == (1, [0])
    assert evaluate(ref, [slow_a, b], plan_of(warm.schedule, 2, warm.warmed))
    # ... unless its prefill ends too late for B: nothing
    assert solve(ref, [replace(a, prefill_ms=3500.0), b]).served == 0


def test_instances_are_not_trivial() -> None:
    """The brute-force comparison means something: optima spread between none and all."""
    served = []
    for seed in range(24):
        rng = random.Random(seed)
        shape = [(1, 1), (2, 1), (1, 2), (2, 2)][seed % 4]
        n = {1: 9, 2: 6, 4: 5}[shape[0] * shape[1]]
        served.append(solve(random_reference(rng, shape), random_jobs(rng, n, seed % 2 == 0)).served / n)
    assert sum(0 < s < 1 for s in served) >= 16


@pytest.mark.parametrize("seed", range(6))
def test_out_of_budget_it_is_an_upper_bound_and_its_schedule_a_lower_one(seed: int) -> None:
    rng = random.Random(100 + seed)
    ref, jobs = random_reference(rng, (1, 1)), random_jobs(rng, 28, bursty=True)
    exact = solve(ref, jobs)
    assert exact.exact
    cut = solve(ref, jobs, node_budget=5, window=6)
    assert (cut.exact, cut.method, cut.inexact_segments) == (False, "upper bound", 1)
    assert cut.served >= exact.served >= len(cut.schedule)
    assert evaluate(ref, jobs, plan_of(cut.schedule, len(jobs)))


@pytest.mark.parametrize("seed", range(8))
def test_more_workers_never_lower_the_optimum(seed: int) -> None:
    rng = random.Random(200 + seed)
    ref, jobs = random_reference(rng, (1, 1)), random_jobs(rng, 9, bursty=seed % 2 == 0)
    base = solve(ref, jobs).served
    assert solve(replace(ref, prefill=2), jobs).served >= base
    assert solve(replace(ref, decode=2), jobs).served >= base


def test_fcfs_greedy_is_beaten_by_skipping_a_long_prompt() -> None:
    """Three requests at once, prefills 1000, 600, 600 ms, TTFT 1300 ms with a 10 ms first step:
    admitting in order serves the first alone; the optimum serves the two short ones."""
    ref = Reference(1, 1, 1300.0, 100.0, FLAT)
    jobs = [Job(0.0, 1000, 2, 1000.0), Job(0.0, 600, 2, 600.0), Job(0.0, 600, 2, 600.0)]
    optimum = solve(ref, jobs)
    assert (optimum.served, optimum.exact, optimum.admitted) == (2, True, frozenset({1, 2}))
    assert not evaluate(ref, jobs, [(0, 0), (0, 0), None])  # 1000 + 600 + 10 > 1300


def test_kv_pool_limits_who_decodes_at_once() -> None:
    ref = Reference(1, 1, 10_000.0, 100.0, FLAT, kv_blocks=10)
    jobs = [Job(0.0, 10, 50, 1.0, kv_blocks=6), Job(0.0, 10, 50, 1.0, kv_blocks=6)]
    assert solve(ref, jobs).served == 1  # both at once would hold 12 blocks
    later = [jobs[0], replace(jobs[1], arrival_ms=600.0)]  # the first has left by then (50 x 10 ms)
    assert solve(ref, later).served == 2


def test_segments_split_at_idle_gaps_and_unservable_requests_drop_out() -> None:
    ref = Reference(1, 1, 1000.0, 100.0, FLAT)
    jobs = [Job(0.0, 10, 5, 100.0), Job(10.0, 10, 5, 100.0), Job(5000.0, 10, 5, 100.0),
            Job(5000.0, 10, 5, 5000.0)]  # the last cannot meet TTFT even alone
    assert servable_alone(ref, jobs) == [0, 1, 2]
    assert segments(ref, jobs, [0, 1, 2]) == [[0, 1], [2]]
    assert solve(ref, jobs).served == 3


@pytest.mark.parametrize("seed", range(5))
def test_load_profile_matches_the_definition_token_by_token(seed: int) -> None:
    """Step per piece = the step of whoever is present; the TBT (per piece, and vectorised) =
    the mean of the longest tenth of the gaps taken one token at a time."""
    rng = random.Random(300 + seed)
    ref = Reference(1, 1, 1e9, 1e9, CPU)
    members = [stay(ref, i, Job(0.0, rng.randint(10, 900), rng.randint(1, 80), 0.0), rng.uniform(0, 3000))
               for i in range(8)]
    load = Load(ref, members)
    for t in (rng.uniform(min(load.times), max(load.times)) for _ in range(50)):
        assert load.step[load.piece(t)] == pytest.approx(step_at(ref, members, t))
    naive = []
    for s in members:
        gaps = sorted((step_at(ref, members, s.ready_ms + g * s.lone_ms) for g in range(1, s.output)), reverse=True)
        top = max(1, len(gaps) // 10)
        naive.append(sum(gaps[:top]) / top if gaps else 0.0)
    assert [load.tbt_ms(s) for s in members] == pytest.approx(naive)
    assert list(tbts_ms(load, members)) == pytest.approx(naive)


def test_jobs_must_come_in_arrival_order() -> None:
    with pytest.raises(ValueError, match="arrival order"):
        solve(Reference(1, 1, 1000.0, 100.0, FLAT), [Job(5.0, 1, 1, 1.0), Job(1.0, 1, 1, 1.0)])
