"""Sampler: distribution sanity on synthetic logits (no model), then seeded reproducibility and
the greedy limits (top_k=1, tiny top_p) through the engine."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from halfmoon.engine.engine import Engine
from halfmoon.engine.request import Request
from halfmoon.engine.sampler import sample
from halfmoon.core.params import SamplingParams

pytestmark = pytest.mark.timeout(120)

PROBS = [0.7, 0.2, 0.1]
DRAWS = 5000
# 5000 draws: the std of a frequency is at most sqrt(0.25 / 5000) = 0.007; 0.03 is > 4 sigma.
FREQ_TOL = 0.03


def fake_request(params: SamplingParams, seed: int = 0) -> Request:
    """A bare Request: the sampler only reads `params` and `generator`."""
    return Request("fake", [0], params, 1, torch.Generator().manual_seed(seed))


def frequencies(params: SamplingParams, probs: list[float] = PROBS, seed: int = 0) -> list[float]:
    """Draw DRAWS tokens for one request (one row per draw, one generator shared by the rows)."""
    logits = torch.tensor(probs).log().expand(DRAWS, -1).contiguous()
    req = fake_request(params, seed)
    counts = Counter(sample(logits, [req] * DRAWS))
    return [counts[i] / DRAWS for i in range(len(probs))]


def expected(probs: list[float], temperature: float = 1.0) -> list[float]:
    scaled = [p ** (1 / temperature) for p in probs]
    return [s / sum(scaled) for s in scaled]


def assert_close(freqs: list[float], want: list[float]) -> None:
    assert all(abs(f - w) < FREQ_TOL for f, w in zip(freqs, want, strict=True)), (freqs, want)


# ---------------------------------------------------------------- synthetic logits


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_temperature_sampling_matches_the_softmax(temperature: float) -> None:
    assert_close(frequencies(SamplingParams(temperature=temperature)), expected(PROBS, temperature))


def test_top_k_2_never_picks_the_third() -> None:
    freqs = frequencies(SamplingParams(temperature=1.0, top_k=2))
    assert freqs[2] == 0.0
    assert_close(freqs, [0.7 / 0.9, 0.2 / 0.9, 0.0])


@pytest.mark.parametrize("top_k", [3, 4, 2**31 - 1, 2**63, 10**22])
def test_a_top_k_at_or_over_the_vocabulary_keeps_every_token(top_k: int) -> None:
    """Schemathesis found `top_k: 57553893800891459305472` (a JSON integer, unbounded) failing
    the engine's whole step: "Overflow when unpacking long long" building the k tensor."""
    assert_close(frequencies(SamplingParams(temperature=1.0, top_k=top_k)), PROBS)


def test_a_vocabulary_not_in_probability_order() -> None:
    """Without top-p the CDF runs in vocabulary order (no sort): the draw still follows p."""
    probs = [0.1, 0.2, 0.7]
    assert_close(frequencies(SamplingParams(temperature=1.0), probs), probs)


def test_each_row_keeps_its_own_top_k() -> None:
    """Rows of top_k 1 and 2 in one batch share one topk of width 2, each cut to its own k."""
    logits = torch.tensor([0.1, 0.2, 0.7]).log().expand(2 * DRAWS, -1).contiguous()
    one, two = fake_request(SamplingParams(temperature=1.0, top_k=1)), fake_request(SamplingParams(temperature=1.0, top_k=2), 1)
    tokens = sample(logits, [one, two] * DRAWS)
    assert set(tokens[0::2]) == {2}
    counts = Counter(tokens[1::2])
    assert_close([counts[i] / DRAWS for i in range(3)], [0.0, 0.2 / 0.9, 0.7 / 0.9])


def test_a_row_without_top_k_keeps_the_whole_vocabulary_beside_one_with_it() -> None:
    """Rows filter by their own parameters: a top-k row in the batch narrows nobody else."""
    probs = [0.1, 0.2, 0.7]
    logits = torch.tensor(probs).log().expand(2 * DRAWS, -1).contiguous()
    narrow, wide = fake_request(SamplingParams(temperature=1.0, top_k=1)), fake_request(SamplingParams(temperature=1.0), 1)
    counts = Counter(sample(logits, [narrow, wide] * DRAWS)[1::2])
    assert_close([counts[i] / DRAWS for i in range(3)], probs)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # 0.7 < 0.75, so the second token is needed to reach 0.75; the third never is.
    freqs = frequencies(SamplingParams(temperature=1.0, top_p=0.75))
    assert freqs[2] == 0.0
    assert_close(freqs, [0.7 / 0.9, 0.2 / 0.9, 0.0])
    assert frequencies(SamplingParams(temperature=1.0, top_p=0.5)) == [1.0, 0.0, 0.0]


def test_top_k_and_top_p_together() -> None:
    probs = [0.4, 0.3, 0.2, 0.1]
    # top_k=3 renormalises to 4/9, 3/9, 2/9; top_p=0.6 then needs the first two (4/9 < 0.6).
    freqs = frequencies(SamplingParams(temperature=1.0, top_k=3, top_p=0.6), probs)
    assert freqs[2] == freqs[3] == 0.0
    assert_close(freqs, [4 / 7, 3 / 7, 0.0, 0.0])


def test_greedy_and_sampled_rows_in_one_batch() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    reqs = [fake_request(SamplingParams()), fake_request(SamplingParams(temperature=1.0, top_k=1)),
            fake_request(SamplingParams())]
    assert sample(logits, reqs) == [1, 0, 2]


def test_seeded_row_does_not_depend_on_its_batch() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0)
    alone = [sample(logits[1:2], [fake_request(params, seed=9)])[0] for _ in range(5)]
    batched = []
    for _ in range(5):
        reqs = [fake_request(params, seed=s) for s in (1, 9, 2, 3)]
        batched.append(sample(logits, reqs)[1])
    assert alone == batched


def test_extreme_logits_stay_finite() -> None:
    logits = torch.tensor([[1e4, -1e4, 0.0], [-math.inf, 0.0, -math.inf]])
    reqs = [fake_request(SamplingParams(temperature=0.01)),
            fake_request(SamplingParams(temperature=5.0))]
    assert sample(logits, reqs) == [0, 1]


@pytest.mark.parametrize("temperature", [1e-4, 1e-30, 1e-38, 1e-44])
def test_tiny_temperature_is_greedy(temperature: float) -> None:
    # A temperature -> 0 limit is greedy. Below ~1e-37, logits / temperature overflows fp32.
    logits = torch.tensor([[40.0, 39.0, -40.0, 10.0]])
    assert sample(logits, [fake_request(SamplingParams(temperature=temperature))]) == [0]


# ---------------------------------------------------------------- through the engine


STORY = "Once upon a time, in a small village,"
OTHERS = ["def add(a, b):", "The capital of France is", "1, 2, 3, 4,"]
N = 16


def run(engine: Engine, texts: list[str], params: list[SamplingParams]) -> list[list[int]]:
    prompts = [engine.tokenizer.encode(t) for t in texts]
    return [r.output_ids for r in engine.generate(prompts, params)]


def sampled(seed: int, **kw: float) -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=kw.pop("temperature", 1.0), seed=seed,
                          ignore_eos=True, **kw)  # type: ignore[arg-type]


@pytest.mark.slow
def test_same_seed_same_tokens_alone_and_batched(engine: Engine) -> None:
    [first] = run(engine, [STORY], [sampled(42)])
    [again] = run(engine, [STORY], [sampled(42)])
    assert first == again
    batch_params = [sampled(7), sampled(42), SamplingParams(max_tokens=N + 5, ignore_eos=True),
                    sampled(8, temperature=0.7, top_p=0.9)]
    batched = run(engine, [OTHERS[0], STORY, OTHERS[1], OTHERS[2]], batch_params)
    assert batched[1] == first


@pytest.mark.slow
def test_different_seeds_differ(engine: Engine) -> None:
    outs = run(engine, [STORY] * 3, [sampled(1), sampled(2), sampled(3)])
    assert len({tuple(o) for o in outs}) == 3


@pytest.mark.slow
def test_top_k_1_and_tiny_top_p_equal_greedy(engine: Engine) -> None:
    greedy = SamplingParams(max_tokens=N, ignore_eos=True)
    outs = run(engine, [STORY] * 3, [greedy, sampled(5, temperature=1.5, top_k=1),
                                     sampled(6, temperature=1.5, top_p=1e-6)])
    assert outs[1] == outs[0] and outs[2] == outs[0]
