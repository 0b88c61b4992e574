"""The optimum's inputs from a replay, and what a policy's outcome looks like beside it.

`sim_optimum` builds sim/optimum.py's jobs and reference from a simulated replay: arrivals and
lengths as replayed, prefill at the best prefix hit the request could have found (the longest
run of leading blocks it shares with any earlier request of the replay, as an unbounded cache
would hold them, as many tokens as the engine reuses of them; no fetch), the KV tail and
`overhead_ms` as the handoff, the SLOs of the default class, the decode worker's KV pool and
each request's booking (prompt + output tokens, in engine blocks). A co-located engine is bounded by
the 1P1D reference without handoff (its prefill never stretches its decodes there), so its
optimum is never called exact. `gap` compares the best schedule with what the policy did.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from conductor.cost_model import CostModel
from conductor.prefill_steps import chunked_prefill_ms
from core.blocks import cdiv
from sim.cluster import Record, SimResult, SpeculativeCost
from sim.optimum import DEFAULT_NODE_BUDGET, Job, Optimum, Reference, solve
from sim.trace import HASH_BLOCK_TOKENS


def best_prefill_ms(cost: CostModel, prompt: int, reusable: Iterable[int], chunk: int | None = None) -> float:
    """The cheapest prefill over the prefix hits it could have had (0 included); `chunk`: a
    prefill worker's step budget (its chunks are steps: conductor/prefill_steps.py)."""
    def alone(hit: int) -> float:
        if chunk is None:
            return cost.est_prefill_ms(prompt - hit, hit)
        return chunked_prefill_ms(cost, prompt - hit, hit, chunk)

    return min(alone(hit) for hit in {0, *reusable} if 0 <= hit < prompt)


def shared_blocks(chains: Sequence[Sequence[bytes]]) -> list[int]:
    """Per request, how many of its leading blocks an earlier request also had (chained ids:
    equal ids at a position mean an equal prefix up to it)."""
    seen: set[bytes] = set()
    out = []
    for chain in chains:
        out.append(next((n for n in range(len(chain), 0, -1) if chain[n - 1] in seen), 0))
        seen.update(chain)
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
    for r, shared in zip(requests, hits, strict=True):
        reusable = reusable_tokens(shared, r.prompt_len, HASH_BLOCK_TOKENS, config.block_size)
        handoff = 0.0 if config.colocated else config.kv_tail * cost.est_transfer_ms(r.prompt_len) + (config.overhead_ms or 0.0)
        chunk = None if config.colocated else config.chunk
        jobs.append(Job(r.arrival_s * 1e3, r.prompt_len, r.output_len, best_prefill_ms(cost, r.prompt_len, reusable, chunk),
                        handoff, cdiv(r.prompt_len + r.output_len, config.block_size)))
    return jobs


def sim_reference(result: SimResult, cost: CostModel) -> Reference:
    config = result.config
    cls = config.admission.classes()[config.admission.default_class]
    step: Any = cost if config.tokens_per_step == 1.0 else SpeculativeCost(cost, config.tokens_per_step)
    shape = (1, 1) if config.colocated else (config.prefill, config.decode)
    return Reference(*shape, cls.ttft_ms or math.inf, cls.tbt_ms or math.inf, step,
                     config.device_tokens // config.block_size)


def sim_optimum(result: SimResult, cost: CostModel, node_budget: int = DEFAULT_NODE_BUDGET) -> Optimum:
    """The optimum of the replay `result` ran (module docstring)."""
    optimum = solve(sim_reference(result, cost), sim_jobs(result, cost), node_budget)
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


def optimum_summary(optimum: Optimum, good: int, window_s: float, outcomes: Sequence[str]) -> dict[str, Any]:
    """The report's `optimum` entry: the optimum, the policy's goodput as a % of it, the gap.
    Out of budget, `served` is an upper bound and `best_schedule` what a schedule found serves:
    the policy's true % of the optimum lies between `pct_of_optimum` and `pct_of_best_schedule`."""
    return {"served": optimum.served, "method": optimum.method, "best_schedule": len(optimum.schedule),
            "goodput_rps": round(optimum.served / window_s, 4) if window_s > 0 else None,
            "pct_of_optimum": round(100 * good / optimum.served, 1) if optimum.served else None,
            "pct_of_best_schedule": round(100 * good / len(optimum.schedule), 1) if optimum.schedule else None,
            "segments": optimum.segments, "inexact_segments": optimum.inexact_segments, "nodes": optimum.nodes,
            "gap": gap(optimum, outcomes)}


def optimum_cell(o: dict[str, Any]) -> str:
    """The optimum in a table: N when exact, else the range the best schedule and the bound span."""
    return str(o["served"]) if o["method"] == "exact" else f"{o['best_schedule']}..{o['served']}"
