"""The offline optimum beside a live admission replay (issue 38; sim/optimum.py's model).

Per replay: the requests as the client sent them (arrival, prompt, max_tokens: outputs are
exactly that long, `ignore_eos`), the server's own cost model (GET /dashboard/api/cost-model:
what admission prices with), the cluster shape from the serve flags (`--prefill N --decode M`;
co-located: the 1P1D reference without handoff, an upper bound only) and the bench's SLOs.
Optimistic where the client cannot see: a prompt's prefill at the best prefix an earlier replay
on the server, or an earlier prompt of this replay *the optimum admitted*, could give (the
token-wise common prefix, never the whole prompt; sim/optimum.py `Job.hits`), no handoff, no KV
limit. The run's `optimum` entry holds the optimum, the policy's SLO-met count as a
% of it, and the requests the optimum's schedule serves that the policy did not, by outcome.
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import numpy as np

from halfmoon.bench.serve_metrics import RequestRecord, Slo, meets_slo, tbt_s
from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.serve_defaults import serve_engine
from halfmoon.core.errors import ConfigError
from halfmoon.sim.optimum import DEFAULT_NODE_BUDGET, Job, Reference, solve
from halfmoon.sim.optimum_jobs import job_prefills, optimum_summary

FETCH_TIMEOUT_S = 10.0


def fetch_cost_model(http_url: str | None) -> CostModel:
    """The running server's cost model; raises ConfigError saying why it cannot be had."""
    if http_url is None:
        raise ConfigError("no HTTP URL to ask for the cost model")
    try:
        with urllib.request.urlopen(f"{http_url.rstrip('/')}/dashboard/api/cost-model",
                                    timeout=FETCH_TIMEOUT_S) as response:
            return CostModel.from_json(response.read().decode())
    except (urllib.error.URLError, OSError) as e:
        raise ConfigError(f"cannot read the server's cost model: {e}") from e


def shape(serve_args: str | None) -> tuple[int, int, bool]:
    """(prefill workers, decode workers, co-located) from `halfmoon serve` flags."""
    args = serve_args or ""
    if "--colocated" in args.split():
        return 1, 1, True

    def count(flag: str) -> int:
        match = re.search(rf"{flag}[ =](\d+)", args)
        return int(match.group(1)) if match else 1

    return count("--prefill"), count("--decode"), False


def step_budget(serve_args: str | None) -> int:
    """A prefill worker's token budget a step: `--max-num-batched-tokens`, else serve's default."""
    match = re.search(r"--max-num-batched-tokens[ =](\d+)", serve_args or "")
    return int(match.group(1)) if match else serve_engine().max_num_batched_tokens


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def prefills(cost: CostModel, prompts: Sequence[np.ndarray], seen: Sequence[np.ndarray],
             chunk: int | None = None) -> list[tuple[float, float | None, tuple[tuple[int, float], ...]]]:
    """Per prompt `job_prefills`: what earlier replays on the same server (`seen`) left is given;
    what an earlier prompt of this replay leaves counts only if that prompt was admitted;
    `chunk`: a prefill worker's step budget (a long prompt's chunks are steps of their own)."""
    out = []
    for i, prompt in enumerate(prompts):
        given = {min(common_prefix(prompt, other), len(prompt) - 1) for other in seen}
        hits = {j: h for j in range(i) if (h := min(common_prefix(prompt, prompts[j]), len(prompt) - 1)) > 0}
        out.append(job_prefills(cost, len(prompt), given, hits, chunk))
    return out


def outcome(r: RequestRecord, slo: Slo) -> str:
    if meets_slo(r, slo):
        return "served"
    if r.status == "rejected":
        return "refused"
    if r.status != "ok":
        return r.status
    if r.ttft_s is not None and r.ttft_s * 1e3 > slo.ttft_ms:
        return "missed TTFT"
    return "missed TBT" if (t := tbt_s(r.token_times)) is not None and t * 1e3 > slo.tbt_ms else "missed"


def replay_optimum(records: Sequence[RequestRecord], prompts: Sequence[np.ndarray], seen: Sequence[np.ndarray],
                   cost: CostModel, serve_args: str | None, slo: Slo, window_s: float,
                   node_budget: int = DEFAULT_NODE_BUDGET) -> dict[str, Any]:
    """The run's `optimum` entry (module docstring); `window_s`: the goodput basis of the run."""
    prefill, decode, colocated = shape(serve_args)
    ref = Reference(prefill, decode, slo.ttft_ms, slo.tbt_ms, cost, math.inf)
    jobs = [Job(r.arrival_s * 1e3, r.prompt_tokens, max(1, r.max_tokens), best, cold_ms=cold, hits=hits)
            for r, (best, cold, hits) in zip(records, prefills(cost, prompts, seen,
                                                               None if colocated else step_budget(serve_args)),
                                             strict=True)]
    optimum = solve(ref, jobs, node_budget)
    if colocated:
        optimum = optimum._replace(exact=False)
    good = sum(meets_slo(r, slo) for r in records)
    summary = optimum_summary(optimum, good, window_s, [outcome(r, slo) for r in records])
    return {**summary, "reference": f"{prefill}P{decode}D" + (" (co-located: bounded by 1P1D)" if colocated else ""),
            "cost_model": json.loads(cost.to_json())["source"] or "the server's"}
