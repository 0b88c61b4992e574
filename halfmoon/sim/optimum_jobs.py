"""The optimum's inputs from a replay, and what a policy's outcome looks like beside it.

`sim_optimum` builds sim/optimum.py's jobs and reference from a simulated replay: arrivals and
lengths as replayed, prefill cold unless an earlier request sharing leading blocks with it was
admitted (`Job.hits`: each such request and the prefill its prefix leaves, as an unbounded cache
would hold it, as many tokens as the engine reuses; no fetch; a request more than `MAX_HITS`
earlier ones share a prefix with takes its best hit as given, optimistic), the KV tail and
`overhead_ms` as the handoff, the SLOs of the default class, the decode worker's KV pool and
each request's booking (prompt + output tokens, in engine blocks). A co-located engine is bounded by
the 1P1D reference without handoff (its prefill never stretches its decodes there), so its
optimum is never called exact. `gap` compares the best schedule with what the policy did.
"""

from __future__ import annotations

import math
import operator
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from functools import reduce
from typing import Any

from halfmoon.conductor.cost_model import CostModel
from halfmoon.core.blocks import cdiv
from halfmoon.sim.cluster import Record, SimResult, SpeculativeCost
from halfmoon.sim.optimum import DEFAULT_NODE_BUDGET, Job, Optimum, Progress, Reference, solve
from halfmoon.sim.trace import HASH_BLOCK_TOKENS

MAX_HITS = 64  # earlier requests sharing a prefix past which a job's best hit is taken as given


def job_prefills(cost: CostModel, prompt: int, given: Iterable[int], hits: dict[int, int],
                 chunk: int | None = None) -> tuple[float, float | None, tuple[tuple[int, float], ...]]:
    """(best prefill, cold prefill, hits) of one job for `Job`: `given` the prefix tokens it finds
    whatever was admitted (earlier replays), `hits` per earlier job of this replay the prefix
    tokens it would leave; more than MAX_HITS: the best taken as given (cold None)."""
    base = {0, *given}
    alone = prefill_by_hit(cost, prompt, base | set(hits.values()), chunk)
    cold = min(alone[h] for h in base if h in alone)
    if len(hits) > MAX_HITS:
        return min(alone.values()), None, ()
    by_hit = {h: min(cold, alone.get(h, cold)) for h in set(hits.values())}
    options = tuple(sorted(((j, by_hit[h]) for j, h in hits.items() if by_hit[h] < cold), key=lambda o: (o[1], o[0])))
    return min([cold, *(ms for _, ms in options)]), cold if options else None, options


def best_prefill_ms(cost: CostModel, prompt: int, reusable: Iterable[int], chunk: int | None = None) -> float:
    """The cheapest prefill over the prefix hits it could have had (0 included); `chunk`: a
    prefill worker's step budget (its chunks are steps: conductor/prefill_steps.py)."""
    return min(prefill_by_hit(cost, prompt, {0, *reusable}, chunk).values())


def prefill_by_hit(cost: CostModel, prompt: int, hits: Iterable[int], chunk: int | None = None) -> dict[int, float]:
    """Per prefix hit (those in [0, prompt)): the prompt's prefill alone after it. Chunked,
    exactly `chunked_prefill_ms`'s sum: hits `chunk` tokens apart step the same chunks from the
    larger one on, so each chunk's step is priced once and each hit sums its own tail in order."""
    valid = sorted({h for h in hits if 0 <= h < prompt})
    if chunk is None:
        return {h: cost.est_prefill_ms(prompt - h, h) for h in valid}
    out: dict[int, float] = {}
    for residue in {h % chunk for h in valid}:
        start = min(h for h in valid if h % chunk == residue)
        steps = [cost.est_prefill_step_ms([(min(chunk, prompt - at), at)]) for at in range(start, prompt, chunk)]
        for h in valid:
            if h % chunk == residue:
                out[h] = reduce(operator.add, steps[(h - start) // chunk:], 0.0)
    return out


def shared_blocks(chains: Sequence[Sequence[bytes]]) -> list[tuple[int, dict[int, int] | None]]:
    """Per request: the most leading blocks it shares with any earlier request, and each earlier
    request sharing some with it and how many (chained ids: equal ids at a position mean an
    equal prefix up to it); None past MAX_HITS such requests (the best is then taken as given)."""
    holders: dict[bytes, dict[int, None]] = {}  # per block, the requests holding it (in order)
    out: list[tuple[int, dict[int, int] | None]] = []
    for i, chain in enumerate(chains):
        shared: dict[int, int] | None = {}
        longest = 0
        for n, block in enumerate(chain, start=1):
            earlier = holders.get(block)
            if not earlier:
                break  # chained: no later block can be shared either
            longest = n
            if shared is not None and len(earlier) > MAX_HITS:
                shared = None  # the update below would hold more than MAX_HITS
            elif shared is not None:
                shared.update(dict.fromkeys(earlier, n))
                shared = shared if len(shared) <= MAX_HITS else None
        out.append((longest, shared))
        for block in chain:
            holders.setdefault(block, {})[i] = None
    return out


def reusable_tokens(blocks: int, prompt: int, hash_block: int, engine_block: int) -> list[int]:
    """The prompt tokens an engine reuses for each count of leading hash blocks hit up to `blocks`
    (sim/tiers.py's `prefix_tokens`: whole engine blocks, never the last prompt token)."""
    cap = (prompt - 1) // engine_block * engine_block
    return [min(b * hash_block, prompt, cap) for b in range(blocks + 1)]


def sim_jobs(result: SimResult, cost: CostModel) -> list[Job]:
    config, requests = result.config, result.workload.requests
    hits = shared_blocks([r.blocks for r in requests])
    jobs = []
    for r, (longest, shared) in zip(requests, hits, strict=True):
        tokens = reusable_tokens(longest, r.prompt_len, HASH_BLOCK_TOKENS, config.block_size)
        handoff = 0.0 if config.colocated else config.kv_tail * cost.est_transfer_ms(r.prompt_len) + (config.overhead_ms or 0.0)
        chunk = None if config.colocated else config.chunk
        if shared is None:  # too many to search: its best hit taken as given
            best, cold, options = best_prefill_ms(cost, r.prompt_len, tokens, chunk), None, ()
        else:
            best, cold, options = job_prefills(cost, r.prompt_len, (), {j: tokens[n] for j, n in shared.items()}, chunk)
        jobs.append(Job(r.arrival_s * 1e3, r.prompt_len, r.output_len, best, handoff,
                        cdiv(r.prompt_len + r.output_len, config.block_size), cold, options))
    return jobs


def sim_reference(result: SimResult, cost: CostModel) -> Reference:
    config = result.config
    cls = config.admission.classes()[config.admission.default_class]
    step: Any = cost if config.tokens_per_step == 1.0 else SpeculativeCost(cost, config.tokens_per_step)
    shape = (1, 1) if config.colocated else (config.prefill, config.decode)
    return Reference(*shape, cls.ttft_ms or math.inf, cls.tbt_ms or math.inf, step,
                     config.device_tokens // config.block_size)


def sim_optimum(result: SimResult, cost: CostModel, node_budget: int = DEFAULT_NODE_BUDGET,
                seconds: float = math.inf, progress: Progress | None = None) -> Optimum:
    """The optimum of the replay `result` ran (module docstring): `seconds` of wall clock from
    here on, building the jobs included (sim/optimum.py `solve`; inf: no limit)."""
    began = time.monotonic()
    jobs = sim_jobs(result, cost)
    left = max(0.0, seconds - (time.monotonic() - began))
    optimum = solve(sim_reference(result, cost), jobs, node_budget, seconds=left, progress=progress)
    optimum = optimum._replace(seconds=time.monotonic() - began, time_budget_s=seconds)
    return optimum._replace(exact=False) if result.config.colocated else optimum


def outcome(r: Record, met: bool, ttft_ms: float, tbt_ms: float) -> str:
    """What became of one request under the policy, in a word or two."""
    if met:
        return "served"
    if r.status == "rejected":
        return f"refused ({r.reason})"
    if r.status != "ok":
        return r.status
    if r.ttft_s is not None and r.ttft_s * 1e3 > ttft_ms:
        return "missed TTFT"
    return "missed TBT" if r.tbt_s is not None and r.tbt_s * 1e3 > tbt_ms else "missed"


def gap(optimum: Optimum, outcomes: Sequence[str]) -> dict[str, Any]:
    """Requests the best schedule serves and the policy did not (by what the policy did with
    them), and requests the policy served that the schedule leaves out."""
    chosen = optimum.admitted
    lost = Counter(o for i, o in enumerate(outcomes) if i in chosen and o != "served")
    extra = sum(o == "served" and i not in chosen for i, o in enumerate(outcomes))
    return {"optimum_only": sum(lost.values()), "optimum_only_by_outcome": dict(sorted(lost.items())),
            "policy_only": extra}


def optimum_summary(optimum: Optimum, good: int, window_s: float, outcomes: Sequence[str],
                    hint: str = "") -> dict[str, Any]:
    """The report's `optimum` entry: the optimum, the policy's goodput as a % of it, the gap.
    Out of budget, `served` is an upper bound and `best_schedule` what a schedule found serves:
    the policy's true % of the optimum lies between `pct_of_optimum` and `pct_of_best_schedule`;
    `bounded_by` says which budget cut how many segments, `note` says so in words (+ `hint`)."""
    return {"served": optimum.served, "method": optimum.method, "best_schedule": len(optimum.schedule),
            "goodput_rps": round(optimum.served / window_s, 4) if window_s > 0 else None,
            "pct_of_optimum": round(100 * good / optimum.served, 1) if optimum.served else None,
            "pct_of_best_schedule": round(100 * good / len(optimum.schedule), 1) if optimum.schedule else None,
            "segments": optimum.segments, "inexact_segments": optimum.inexact_segments, "nodes": optimum.nodes,
            "warmed": len(optimum.warmed),  # requests its schedule prefills only to warm the cache
            "bounded_by": {"time": optimum.timed_out, "nodes": optimum.inexact_segments - optimum.timed_out},
            "budget": {"nodes": optimum.node_budget,
                       "seconds": optimum.time_budget_s if math.isfinite(optimum.time_budget_s) else None},
            "search_s": round(optimum.seconds, 3), "note": bound_note(optimum, hint),
            "gap": gap(optimum, outcomes)}


def bound_note(optimum: Optimum, hint: str = "") -> str | None:
    """Why the optimum is an upper bound, in words (None when exact), then `hint` (how to get
    the exact figure with the caller's flags)."""
    if optimum.exact:
        return None
    if not optimum.inexact_segments:
        return "upper bound, not exact: a co-located engine is bounded by the 1P1D reference"
    seconds = f"{optimum.time_budget_s:g} s in all" if math.isfinite(optimum.time_budget_s) else "no time limit"
    nodes = optimum.inexact_segments - optimum.timed_out
    return (f"upper bound, not exact: {optimum.inexact_segments} of {optimum.segments} segments bounded, "
            f"{optimum.timed_out} by the time budget ({seconds}) and {nodes} by the node budget "
            f"({optimum.node_budget} nodes a segment){'; ' + hint if hint else ''}")


def optimum_cell(o: dict[str, Any]) -> str:
    """The optimum in a table: N when exact, else the range the best schedule and the bound span."""
    return str(o["served"]) if o["method"] == "exact" else f"{o['best_schedule']}..{o['served']}"
