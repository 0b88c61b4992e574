"""Speculative decoding (engine/speculative.py): exact, on only where it pays.

Greedy output with n-gram speculation is token-identical to decoding without it (SmolLM2 on
prompts that quote themselves and ones that do not, in a batch, with stop strings, EOS and
max_tokens landing inside a verified run; every model family); sampled tokens follow the
target's distribution (chi-square over many draws of `verify` on a small vocabulary); the
prefix cache only ever holds verified tokens; requests prefilling in the steps where others
verify (staggered arrivals, preemption) are unchanged; the pool is intact afterwards."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from halfmoon.core.params import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.engine.request import Request
from halfmoon.engine.speculative import NgramProposer, SpeculativeConfig, Speculator, StepCostTable, verify
from halfmoon.kvpool.block_hash import block_hashes
from tests.conftest import EngineFactory
from tests.engine.staggered_support import staggered

pytestmark = [pytest.mark.timeout(300)]

QUOTING = ("Repeat this sentence exactly, twice: The committee approved the budget for the new library "
           "on Tuesday evening after a long debate.\nAnswer:")
PLAIN = "Write a haiku about autumn leaves."
STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def encode(engine: Engine, *texts: str) -> list[list[int]]:
    return [engine.tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def pair(make_engine: EngineFactory) -> tuple[Engine, Engine]:
    """(without, with) n-gram speculation: fp32 SmolLM2 on the shared weights."""
    return make_engine(num_blocks=192), make_engine(num_blocks=192, speculative="ngram")


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    out = [r.output_ids for r in engine.generate(prompts, params)]
    engine.pool.check_integrity()
    return out


def test_greedy_is_token_identical_with_and_without_speculation(pair: tuple[Engine, Engine]) -> None:
    plain, spec = pair
    prompts = encode(plain, QUOTING, PLAIN, STORY)
    before = spec.speculator.stats.accepted
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    assert run(spec, prompts, params) == run(plain, prompts, params)
    assert spec.speculator.stats.accepted - before > 20  # it did speculate (and accept) here


@pytest.mark.parametrize("num_blocks", [192, 10])
def test_requests_prefilling_beside_verifications_are_unchanged(pair: tuple[Engine, Engine], make_engine: EngineFactory,
                                                                num_blocks: int) -> None:
    """Staggered arrivals: requests prefill in the steps where the quoting request verifies
    n-gram drafts (such steps once gave both wrong tokens: engine/runner.py); with 10 blocks a
    drafting request is also preempted and recomputed."""
    plain, _ = pair
    spec = make_engine(num_blocks=num_blocks, speculative="ngram")
    prompts = encode(plain, QUOTING, PLAIN, STORY, "def fibonacci(n):")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    got, mixed = staggered(spec, prompts, params)
    assert got == run(plain, prompts, params)
    assert mixed > 0 and spec.speculator.stats.accepted > 0
    assert (spec.scheduler.stats.preemptions > 0) == (num_blocks == 10)
    spec.pool.check_integrity()


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=13, ignore_eos=True),  # max_tokens inside a verified run
    SamplingParams(max_tokens=40, stop=("library",)),  # a stop string inside one
    SamplingParams(max_tokens=40, stop_token_ids=(198,)),  # a stop id (newline)
    SamplingParams(max_tokens=64),  # EOS
], ids=["max-tokens", "stop-string", "stop-id", "eos"])
def test_stops_land_where_they_would_without_speculation(pair: tuple[Engine, Engine], params: SamplingParams) -> None:
    plain, spec = pair
    prompts = encode(plain, QUOTING, STORY)
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [(r.output_ids, r.text, r.finish_reason) for r in got] == [(r.output_ids, r.text, r.finish_reason)
                                                                      for r in want]
    spec.pool.check_integrity()


def test_a_request_can_opt_out(pair: tuple[Engine, Engine]) -> None:
    _, spec = pair
    before = spec.speculator.stats.steps
    spec.generate(encode(spec, QUOTING), SamplingParams(max_tokens=24, ignore_eos=True, speculative=False))
    assert spec.speculator.stats.steps == before


def test_the_prefix_cache_holds_only_verified_tokens(make_engine: EngineFactory) -> None:
    """Every cached block's hash is one of the final sequences' block hashes: no rejected
    draft ever reached the cache (a block hashed over a draft would hash differently)."""
    spec = make_engine(num_blocks=96, speculative="ngram")
    prompts = encode(spec, QUOTING, STORY)
    results = spec.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.9, seed=3))
    assert spec.speculator.stats.proposed > spec.speculator.stats.accepted > 0  # some drafts were rejected
    valid: set[bytes] = set()
    for prompt, r in zip(prompts, results):
        root = spec._root_hash(len(prompt), None)
        valid.update(block_hashes(prompt + r.output_ids, spec.config.block_size, root))
    cached = set(spec.pool.cached_hashes())
    assert cached and cached <= valid
    spec.pool.check_integrity()
    assert spec.pool.num_free() == spec.pool.num_blocks  # zero leaked blocks


def test_every_family_is_unchanged_by_speculation(tmp_path: Path) -> None:
    from tests.model_families import CASES, NEW, build_checkpoint, hf_greedy, prompts

    for case in CASES:
        model = build_checkpoint(case, tmp_path / case.name)
        ids = prompts(2)
        engine = Engine(EngineConfig(model=str(tmp_path / case.name), num_blocks=64, num_threads=1,
                                     max_num_batched_tokens=32, speculative="ngram"))
        got = [r.output_ids for r in engine.generate(ids, SamplingParams(max_tokens=NEW, ignore_eos=True))]
        assert got == [hf_greedy(model, p) for p in ids], case.name
        engine.pool.check_integrity()


# ---------------------------------------------------------------- the sampler's exactness


def _req(seed: int, **params: object) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(**params), 3, torch.Generator().manual_seed(seed))


def _chi_square_p(counts: Counter[int], probs: torch.Tensor, draws: int) -> float:
    """Pearson's chi-square test of `counts` against `probs`: the p-value (the chi-square
    survival function is the regularised upper incomplete gamma Q(df / 2, x / 2))."""
    support = [i for i in range(probs.shape[0]) if probs[i] > 0]
    observed = torch.tensor([float(counts.get(i, 0)) for i in support], dtype=torch.float64)
    expected = torch.tensor([float(probs[i]) * draws for i in support], dtype=torch.float64)
    assert sum(counts.values()) == draws and set(counts) <= set(support)
    statistic = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor((len(support) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, statistic / 2))


@pytest.mark.parametrize("draft_kind", ["one-hot", "distribution"])
def test_sampled_tokens_follow_the_target_distribution(draft_kind: str) -> None:
    """First emitted token ~ p0 (accepted draft or residual draw), and the second one, given the
    first draft was accepted, ~ p1: chi-square over 20k draws, vocabulary 6. A draft model's
    tokens are drawn from its own distribution q each time (the method's premise); an n-gram
    draft is fixed (q one-hot)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=g) * 1.5
    target = torch.softmax(logits / 0.8, dim=-1)
    draft = [2, 4]
    q = torch.softmax(torch.randn(2, 6, generator=g), dim=-1) if draft_kind == "distribution" else None
    draws = 20_000
    req = _req(7, temperature=0.8)
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    dg = torch.Generator().manual_seed(99)
    for _ in range(draws):
        if q is not None:
            draft = [int(torch.multinomial(q[j], 1, generator=dg)) for j in range(2)]
        out = verify(logits, draft, req, q)
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
    assert _chi_square_p(first, target[0], draws) > 1e-3
    assert _chi_square_p(second, target[1], sum(second.values())) > 1e-3
    # the test has power: the draft's own distribution (what a broken acceptance would emit) fails
    wrong = 0.5 * target[0] + 0.5 * (q[0] if q is not None else torch.eye(6)[draft[0]])
    assert _chi_square_p(first, wrong, draws) < 1e-6


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(pair: tuple[Engine, Engine]) -> None:
    """An n-gram draft passes iff it is the token the target's own draw yields there, one draw
    per emitted token: the generator runs as without speculation, so the tokens are the same."""
    plain, spec = pair
    params = [SamplingParams(max_tokens=40, temperature=t, top_p=p, seed=s, ignore_eos=True)
              for t, p, s in ((0.8, 1.0, 11), (1.2, 0.9, 5), (0.5, 1.0, 99))]
    ids = encode(plain, QUOTING) * 3
    before = spec.speculator.stats.accepted
    want = [r.output_ids for r in plain.generate(ids, params)]
    assert [r.output_ids for r in spec.generate(ids, params)] == want
    assert spec.speculator.stats.accepted > before  # drafts were accepted while sampling
    spec.pool.check_integrity()


# ---------------------------------------------------------------- proposer and policy


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    proposer = NgramProposer(ngram_max=3, ngram_min=2)
    req = _req(0)
    req.token_ids = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7]
    assert proposer.propose(req, 3) == [1, 2, 5]  # the latest earlier [5, 6, 7] was followed by 1 2 5
    req.token_ids += [1]
    assert proposer.propose(req, 2) == [2, 5]  # [6, 7, 1] seen once before
    req.token_ids = [3, 4]
    proposer.forget("r")
    assert proposer.propose(req, 4) == []


def test_policy_turns_itself_off_above_the_batch_crossover() -> None:
    spec = Speculator(SpeculativeConfig("ngram", max_draft=4, max_batch=2), max_model_len=512)
    reqs = []
    for i in range(3):
        r = _req(i, max_tokens=50)
        r.request_id = f"r{i}"
        r.token_ids = [1, 2, 3, 4, 1, 2, 3]
        r.num_computed_tokens = len(r.token_ids) - 1
        reqs.append(r)
    assert spec.drafts(reqs[:2], budget=64)  # batch 2: on
    assert spec.drafts(reqs, budget=64) == {} and spec.stats.skipped_batch == 1  # batch 3: off
    # a request that keeps rejecting drafts gets shorter ones, then none
    for _ in range(10):
        spec.record(reqs[0], 4, 0)
    assert spec.draft_length(reqs[0], 1) == 0
    assert spec.draft_length(reqs[1], 1) >= 2


def test_measured_step_costs_set_the_crossover() -> None:
    """Rows cost little until the step is compute-bound: the crossover is where a draft row
    costs as much as the tokens it is expected to bring."""
    spec = Speculator(SpeculativeConfig("ngram", max_draft=4), max_model_len=512)
    for rows, seconds in [(1, 0.010), (2, 0.0105), (4, 0.011), (8, 0.013), (16, 0.026), (32, 0.052), (64, 0.104)]:
        for _ in range(3):
            spec.cost.observe(rows, seconds)
    assert spec.cost.row_cost(1) == pytest.approx(0.05)
    assert spec.cost.max_batch() == 7  # at 8 rows each draft row adds 1/8 of the step: for 8 requests no k pays


def test_profile_prints_the_crossover_from_its_decode_steps() -> None:
    """`halfmoon profile`'s decode steps give the crossover at the prior and a quoting acceptance;
    the steps of the shortest context per request are the ones used."""
    from halfmoon.cli.profile import speculation_line
    from halfmoon.core.messages import DecodeSample, Profile

    steps = [(1, 10.0), (2, 10.5), (4, 11.0), (8, 13.0), (16, 26.0)]
    decode = (tuple(DecodeSample(b, 16 * b, ms) for b, ms in steps)  # context_tokens: the whole batch's
              + tuple(DecodeSample(b, 128 * b, 99.0) for b, _ in steps))
    line = speculation_line(Profile((), decode, 1, "test"))
    assert "acceptance 60%: pays up to batch 7" in line and "acceptance 80%: pays up to batch 7" in line
    cheap = tuple(DecodeSample(b, 16 * b, 10.0 + 0.01 * b) for b in (1, 2, 4))
    assert "pays at every batch measured (<= 2)" in speculation_line(Profile((), cheap, 1, "test"))
    table = StepCostTable.from_steps(SpeculativeConfig("ngram"), {b: ms / 1e3 for b, ms in steps})
    assert table.measured_crossover(0.6) == 7 and table.max_batch() == 7
    assert StepCostTable(SpeculativeConfig("ngram")).measured_crossover(0.6) is None


def test_a_verification_step_stays_within_the_slowdown_cap() -> None:
    """Draft rows are capped so a step costs at most `max_slowdown` plain steps: a request whose
    drafts are all rejected waits at most that long for its token."""
    spec = Speculator(SpeculativeConfig("ngram", max_draft=6, max_slowdown=1.5), max_model_len=512)
    for rows, seconds in [(1, 0.010), (2, 0.011), (4, 0.012), (8, 0.014), (16, 0.028)]:
        for _ in range(3):
            spec.cost.observe(rows, seconds)
    assert spec.cost.row_cost(1) == pytest.approx(0.1) and spec.slowdown_rows(1) == 5
    assert spec.cost.row_cost(4) == pytest.approx(1 / 24) and spec.slowdown_rows(4) == 12
    with pytest.raises(ValueError):
        SpeculativeConfig("ngram", max_slowdown=0.9)
