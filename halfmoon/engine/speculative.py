"""Speculative decoding: draft a few tokens cheaply, verify them in one forward of the target.

    step t:   inputs  | x_p | d_1 | d_2 | ... | d_k |      (x_p: the last verified token)
              logits  | r_0 | r_1 | r_2 | ... | r_k |      r_j: the target's next-token row after input j
    accept d_{j+1} against r_j while it passes; at the first rejection emit the target's
    correction from r_j (the residual distribution), or the bonus token from r_k when all pass.

So a step emits a + 1 tokens (a accepted drafts, 0 <= a <= k). A deterministic draft (n-gram)
passes iff it equals the token the target itself yields at that position — its argmax, or, when
sampling, the token `sample` draws with the request's next uniform (one draw per emitted token,
in order): so greedy AND seeded sampled output are token-identical to decoding without
speculation, and a draft d passes with probability p(d), the optimal rate for a one-hot proposal.
A draft drawn from a distribution q (a draft model) passes with probability min(1, p(d) / q(d))
and a rejection draws from the residual max(p - q, 0), renormalised: the emitted tokens are
distributed exactly as the target's (Leviathan et al. 2023; Chen et al. 2023), reproducible with
the request's seed.

KV of rejected drafts was written to slots past the verified tokens: `num_computed_tokens` only
advances over verified ones, the next step overwrites those slots, and blocks are hashed and
registered only up to `num_computed_tokens` — an unverified token never enters the prefix cache,
the tiers or the index.

Draft sources (`Proposer`): n-gram prompt lookup (`NgramProposer`: the last n tokens matched
against everything earlier in prompt + output, the tokens that followed proposed).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from halfmoon.engine.config import DRAFT_PREFIX, SPECULATIVE_MODES, EngineConfig
from halfmoon.engine.request import Request
from halfmoon.engine.sampler import probabilities, sample


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """mode: off | ngram. max_draft: most tokens drafted per request and step. max_batch: the
    batch size from which speculation is off (verifying k tokens for many requests costs more
    than it saves; 0 = the crossover measured from the engine's own step times, `StepCostTable`).
    ngram_max / ngram_min: the longest and shortest suffix matched. max_slowdown: a verification
    step costs at most this many plain steps (its draft rows are capped to fit), so a request
    whose drafts are all rejected waits at most that long for its one token: the longest gaps,
    which TBT measures, stay near a plain step's."""

    mode: str = "off"  # off | ngram | draft (`draft_model` drafts)
    max_draft: int = 6
    max_batch: int = 0
    ngram_max: int = 4
    ngram_min: int = 2
    draft_model: str = ""
    max_slowdown: float = 1.5

    def __post_init__(self) -> None:
        if self.mode == "draft" and not self.draft_model:
            raise ValueError("speculative mode 'draft' needs a draft model")
        if self.mode not in (*SPECULATIVE_MODES, "draft"):
            raise ValueError(f"speculative mode {self.mode!r} not supported ({', '.join(SPECULATIVE_MODES)})")
        if (not 1 <= self.max_draft <= 16 or self.max_batch < 0 or not 1 <= self.ngram_min <= self.ngram_max
                or not self.max_slowdown >= 1.0):
            raise ValueError(f"invalid speculative settings {self}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @classmethod
    def of(cls, config: EngineConfig) -> SpeculativeConfig:
        if config.speculative.startswith(DRAFT_PREFIX):
            return cls("draft", config.speculative_tokens, config.speculative_max_batch,
                       draft_model=config.speculative.removeprefix(DRAFT_PREFIX))
        return cls(config.speculative, config.speculative_tokens, config.speculative_max_batch)


class Proposer(Protocol):
    def propose(self, req: Request, k: int) -> list[int]:
        """Up to `k` draft tokens to follow `req.token_ids` ([] = nothing worth verifying)."""

    def forget(self, request_id: str) -> None:
        """The request ended: drop its state."""


@dataclass(slots=True)
class _NgramIndex:
    """Per request: for each suffix length n, the end (exclusive) of the latest occurrence of
    every n-gram that ends before the current last token, built incrementally."""

    last: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending at positions < indexed are in `last`


class NgramProposer:
    """Prompt lookup: the longest suffix (ngram_max .. ngram_min tokens) seen earlier in the
    request's prompt + output proposes what followed its latest occurrence."""

    def __init__(self, ngram_max: int = 4, ngram_min: int = 2) -> None:
        self.sizes = range(ngram_max, ngram_min - 1, -1)
        self._index: dict[str, _NgramIndex] = {}

    def propose(self, req: Request, k: int) -> list[int]:
        ids = req.token_ids
        index = self._catch_up(req.request_id, ids)
        for n in self.sizes:
            if len(ids) <= n:
                continue
            end = index.last.setdefault(n, {}).get(tuple(ids[-n:]))
            if end is not None:
                return ids[end : min(end + k, len(ids))]
        return []

    def _catch_up(self, request_id: str, ids: list[int]) -> _NgramIndex:
        index = self._index.setdefault(request_id, _NgramIndex())
        for end in range(max(index.indexed, 1), len(ids)):  # n-grams ending before the last token
            for n in self.sizes:
                if end >= n:
                    index.last.setdefault(n, {})[tuple(ids[end - n : end])] = end
        index.indexed = max(index.indexed, len(ids))
        return index

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)


def verify(logits: torch.Tensor, draft: Sequence[int], req: Request,
           draft_probs: torch.Tensor | None = None) -> list[int]:
    """The tokens a verification step emits: accepted drafts, then the correction or bonus.

    logits: [len(draft) + 1, vocab] fp32, row j after input j; draft_probs: [len(draft), vocab]
    the draft's distributions (None: deterministic proposals, q = one-hot)."""
    if draft_probs is None:  # deterministic drafts (n-gram): the target's own sample decides
        return _coupled(logits, draft, req)
    p = probabilities(logits, [req] * logits.shape[0])
    out = []
    for j, d in enumerate(draft):
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
        accept = min(1.0, float(p[j, d]) / q_d) if q_d > 0 else 0.0
        if _uniform(req) < accept:
            out.append(d)
            continue
        if draft_probs is None:
            q = torch.zeros_like(p[j])
            q[d] = 1.0
        else:
            q = draft_probs[j]
        return [*out, _draw(torch.clamp(p[j] - q, min=0.0), req, fallback=p[j])]
    return [*out, _draw(p[len(draft)], req)]


def _coupled(logits: torch.Tensor, draft: Sequence[int], req: Request) -> list[int]:
    """Each position's token is what `sample` would draw there (argmax, or one uniform of the
    request's generator, in order), and a draft passes iff it equals it. For a one-hot proposal
    this accepts with probability p(d) (rejection sampling's own rate) and emits the very
    tokens plain decoding would: the generator consumes one draw per emitted token, as without
    speculation, so a seeded request's output is the same with and without it."""
    out: list[int] = []
    for j in range(len(draft) + 1):
        row = logits[j : j + 1]
        token = int(row.argmax()) if req.params.greedy else sample(row, [req])[0]
        out.append(token)
        if j == len(draft) or token != draft[j]:
            return out
    return out


def _uniform(req: Request) -> float:
    return float(torch.rand(1, generator=req.generator))


def _draw(weights: torch.Tensor, req: Request, fallback: torch.Tensor | None = None) -> int:
    """One token from unnormalised `weights` by inverse CDF with the request's generator. An
    empty residual (p == q up to rounding, so a rejection had probability ~0) draws from
    `fallback` (p itself, which is then the residual's limit)."""
    cdf = weights.cumsum(dim=0)
    total = float(cdf[-1])
    if not total > 1e-12 or math.isnan(total):
        if fallback is None:
            raise ValueError("cannot sample from an empty distribution")
        cdf = fallback.cumsum(dim=0)
        total = float(cdf[-1])
    u = _uniform(req) * total
    return int(torch.searchsorted(cdf, torch.tensor([u])).clamp_(max=cdf.shape[0] - 1))


@dataclass(slots=True)
class SpeculationStats:
    """Counters since the engine started (`/metrics`, the dashboard, `bench engine`)."""

    steps: int = 0  # verification entries (one request, one step)
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # of which accepted
    emitted: int = 0  # tokens those verifications emitted (accepted + one each)
    skipped_batch: int = 0  # steps in which speculation was off for the batch size

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0


class Speculator:
    """The scheduler's speculation policy and draft source, per step and per request.

    Per request, the draft length k maximises the expected tokens a verification emits,
    E(k) = (1 - a^(k+1)) / (1 - a) for the request's measured acceptance a (an exponential
    average, prior `PRIOR_ACCEPTANCE`), over its cost relative to a plain decode step,
    1 + batch * k * `cost.row_cost(batch)`; k = 0 (plain decode) when no k pays. Above the
    batch size where verifying costs more than it saves (`cost.max_batch`, measured: see
    `StepCostTable`), speculation is off for the whole step."""

    PRIOR_ACCEPTANCE = 0.6
    EMA = 0.3  # weight of the newest verification in a request's acceptance

    def __init__(self, config: SpeculativeConfig, max_model_len: int, cost: StepCostTable | None = None,
                 proposer: Proposer | None = None) -> None:
        """`proposer`: the draft source (default: n-gram prompt lookup; a draft model's is built
        by the engine, engine/draft_model.py)."""
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpeculationStats()
        self.cost = cost or StepCostTable(config, self.typical_acceptance)
        self.proposer: Proposer = proposer or NgramProposer(config.ngram_max, config.ngram_min)
        self._acceptance: dict[str, float] = {}

    def drafts(self, running: Sequence[Request], budget: int) -> dict[str, tuple[int, ...]]:
        """Draft tokens for this step's decoding requests, by request id (none: plain decode).
        A step that also prefills verifies as any other (its chunks follow the verification
        rows: engine/runner.py)."""
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1 and r.params.speculative]
        if not decoding:
            return {}
        batch = len(running)
        if batch > self.cost.max_batch():
            self.stats.skipped_batch += 1
            return {}
        spare = min(budget - batch, self.slowdown_rows(batch))  # token budget and step-time cap
        out: dict[str, tuple[int, ...]] = {}
        for req in decoding:
            limit = min(self.draft_length(req, batch), spare,
                        req.params.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens)
            if limit <= 0:
                continue
            draft = self.proposer.propose(req, limit)
            if draft:
                out[req.request_id] = tuple(draft)
                spare -= len(draft)
        return out

    def slowdown_rows(self, batch: int) -> int:
        """Draft rows a step of `batch` requests may add within `max_slowdown` plain steps."""
        row = self.cost.row_cost(batch)
        extra = self.config.max_slowdown - 1.0
        return self.config.max_draft * batch if row <= 0 else int(extra / row + 1e-9)

    def typical_acceptance(self) -> float:
        """The engine's measured acceptance so far (the prior until 32 drafts were verified)."""
        s = self.stats
        return min(s.acceptance, 0.99) if s.proposed >= 32 else self.PRIOR_ACCEPTANCE

    def draft_length(self, req: Request, batch: int) -> int:
        a = min(self._acceptance.get(req.request_id, self.PRIOR_ACCEPTANCE), 0.99)
        row = self.cost.row_cost(batch)
        best_k, best = 0, 1.0
        for k in range(1, self.config.max_draft + 1):  # every request of the batch drafting k
            gain = (1 - a ** (k + 1)) / (1 - a) / (1 + batch * k * row)
            if gain > best:
                best_k, best = k, gain
        return best_k

    def record(self, req: Request, proposed: int, accepted: int) -> None:
        req.spec_proposed += proposed
        req.spec_accepted += accepted
        old = self._acceptance.get(req.request_id, self.PRIOR_ACCEPTANCE)
        self._acceptance[req.request_id] = (1 - self.EMA) * old + self.EMA * (accepted / proposed)
        s = self.stats
        s.steps, s.proposed, s.accepted, s.emitted = s.steps + 1, s.proposed + proposed, s.accepted + accepted, s.emitted + accepted + 1

    def forget(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)
        self.proposer.forget(request_id)


class StepCostTable:
    """What a verification costs relative to a plain decode step, measured on this machine: the
    engine's forward time by the number of rows it computed (power-of-two buckets, exponential
    averages; `observe` after every step). Before enough steps are seen, the configured
    `max_batch` (from `halfmoon profile`'s measured crossover; 0 = `DEFAULT_MAX_BATCH`) and
    `DEFAULT_ROW_COST` stand in.

    row_cost(b): (T(2b) - T(b)) / (b * T(b)) — one extra row's cost relative to a step of b rows;
    b requests drafting k tokens each cost 1 + b * k * row_cost(b) plain steps.
    max_batch: the largest batch whose best draft length still pays at the acceptance measured."""

    DEFAULT_ROW_COST = 0.1
    DEFAULT_MAX_BATCH = 8
    MIN_SAMPLES = 3

    def __init__(self, config: SpeculativeConfig, acceptance: Callable[[], float] | None = None) -> None:
        self.config = config
        self.acceptance = acceptance or (lambda: Speculator.PRIOR_ACCEPTANCE)
        self._time: dict[int, float] = {}  # bucket (rows, a power of two) -> seconds
        self._count: dict[int, int] = {}

    def observe(self, rows: int, seconds: float) -> None:
        bucket = 1 << max(0, rows - 1).bit_length()
        n = self._count.get(bucket, 0)
        self._count[bucket] = n + 1
        old = self._time.get(bucket)
        self._time[bucket] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def _measured(self, rows: int) -> float | None:
        bucket = 1 << max(0, rows - 1).bit_length()
        return self._time.get(bucket) if self._count.get(bucket, 0) >= self.MIN_SAMPLES else None

    def row_cost(self, batch: int) -> float:
        base, double = self._measured(batch), self._measured(2 * batch)
        if base is None or double is None or base <= 0:
            return self.DEFAULT_ROW_COST
        return max(0.0, (double - base) / (batch * base))

    def max_batch(self) -> int:
        """The configured crossover, else the measured one; `DEFAULT_MAX_BATCH` until measured."""
        if self.config.max_batch:
            return self.config.max_batch
        measured = self.measured_crossover(self.acceptance())
        return self.DEFAULT_MAX_BATCH if measured is None else measured

    def measured_crossover(self, acceptance: float) -> int | None:
        """The smallest measured batch at which no draft length pays at `acceptance`, less one;
        None while it pays at every batch measured (or none is)."""
        a = min(acceptance, 0.99)
        for bucket in sorted(self._time):
            if self._measured(bucket) is None or self._measured(2 * bucket) is None:
                continue
            c = self.row_cost(bucket)
            if all((1 - a ** (k + 1)) / (1 - a) <= 1 + bucket * k * c for k in range(1, self.config.max_draft + 1)):
                return max(0, bucket - 1)
        return None

    @classmethod
    def from_steps(cls, config: SpeculativeConfig, step_s: dict[int, float]) -> StepCostTable:
        """A table from step times measured elsewhere (`halfmoon profile`'s decode steps: rows ->
        seconds), each counted as `MIN_SAMPLES` observations."""
        table = cls(config)
        for rows, seconds in sorted(step_s.items()):
            for _ in range(cls.MIN_SAMPLES):
                table.observe(rows, seconds)
        return table
