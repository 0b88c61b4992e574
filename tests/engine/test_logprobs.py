"""Logprobs and logit processing on the engine (issue 46), against transformers (fp32, greedy):
each generated token's logprob and its top-5 equal transformers' log_softmax at that position
within 2e-3; biases, min_tokens and the penalties give the tokens of a reference implementation
of the documented formula on transformers' logits (tests/engine/logprobs_support.py); both with
speculative decoding on and off (n-gram drafts on repetitive prompts: verification rows count the
drafts before them). The tiny families, 1P1D and TP=2: test_logprobs_families.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from halfmoon.conductor.backend import GenerationInput
from halfmoon.conductor.migration import Progress
from halfmoon.core.errors import InvalidRequestError
from halfmoon.core.messages import PrefilledKV, TokenLogprobs
from halfmoon.core.params import SamplingParams
from halfmoon.engine.engine import Engine
from tests.conftest import EngineFactory
from tests.engine.logprobs_support import (penalty_cases, assert_follows_reference, assert_logprobs, assert_prompt_logprobs,
                                           hf_logprobs)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
NEW = 12
TEXTS = ["The capital of France is", "one two three one two three one two three one two",
         "def fibonacci(n):\n    if n < 2:\n        return n\n    return"]


@pytest.fixture(scope="module")
def hf(gguf_path: Path, shared_engine: Engine) -> Any:
    pytest.importorskip("transformers")
    from halfmoon.bench.hf_reference import hf_model

    return hf_model(gguf_path, torch.float32)


@pytest.fixture(scope="module", params=["off", "ngram"])
def engines(request: pytest.FixtureRequest, make_engine: EngineFactory, shared_engine: Engine) -> Engine:
    if request.param == "off":
        return shared_engine
    return make_engine(num_blocks=256, speculative="ngram", speculative_max_batch=8)


def test_logprobs_equal_transformers_log_softmax(engines: Engine, hf: Any) -> None:
    prompts = [engines.tokenizer.encode(t) for t in TEXTS]
    results = engines.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=5))
    for prompt, result in zip(prompts, results):
        assert len(result.output_ids) == NEW
        assert_logprobs(hf_logprobs(hf, prompt + result.output_ids), prompt, result.output_ids, result.logprobs, 5)


def test_logprobs_zero_gives_the_chosen_token_only_and_none_gives_nothing(engine: Engine) -> None:
    ids = engine.tokenizer.encode(TEXTS[0])
    zero, none = engine.generate([ids, ids], [SamplingParams(max_tokens=4, logprobs=0), SamplingParams(max_tokens=4)])
    assert zero.logprobs is not None and all(lp.top == () and lp.logprob <= 0 for lp in zero.logprobs)
    assert none.logprobs is None and zero.output_ids == none.output_ids


CASES = penalty_cases(NEW)


@pytest.mark.parametrize("case", sorted(CASES))
def test_penalties_and_bias_equal_the_reference(engines: Engine, hf: Any, case: str) -> None:
    params = CASES[case]
    for text in TEXTS[1:]:
        prompt = engines.tokenizer.encode(text)
        got = engines.generate([prompt], params)[0].output_ids
        assert_follows_reference(hf, prompt, params, engines.stop_ids, got)


def test_min_tokens_holds_back_eos_until_then(engine: Engine) -> None:
    eos = sorted(engine.stop_ids)[0]
    prompt = engine.tokenizer.encode(TEXTS[0])
    plain = engine.generate([prompt], SamplingParams(max_tokens=8, logit_bias={eos: 100.0}))[0]
    assert plain.output_ids == [eos] and plain.finish_reason.value == "stop"  # the bias makes EOS certain
    held = engine.generate([prompt], SamplingParams(max_tokens=8, min_tokens=5, logit_bias={eos: 100.0}))[0]
    assert len(held.output_ids) == 6 and held.output_ids[-1] == eos and eos not in held.output_ids[:5]


def test_min_tokens_holds_back_stop_strings_too(engine: Engine) -> None:
    """A stop string completed before min_tokens outputs does not end the request (vLLM's rule)."""
    prompt = engine.tokenizer.encode(TEXTS[1])
    free = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop = engine.tokenizer.decode(free.output_ids[:2]).strip()
    assert stop, "the first outputs spell nothing to stop on"
    early = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    assert early.finish_reason.value == "stop" and len(early.output_ids) <= 2
    held = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop], min_tokens=6))[0]
    assert len(held.output_ids) >= 6 and held.output_ids[:6] == free.output_ids[:6]


def test_bad_values_name_their_field(engine: Engine) -> None:
    for field, kwargs in [("frequency_penalty", {"frequency_penalty": 2.5}), ("presence_penalty", {"presence_penalty": float("nan")}),
                          ("repetition_penalty", {"repetition_penalty": 0.0}), ("logit_bias", {"logit_bias": {10**9: 1.0}}),
                          ("logit_bias", {"logit_bias": {5: 101.0}}), ("min_tokens", {"min_tokens": -1}),
                          ("logprobs", {"logprobs": 21}), ("logprobs", {"logprobs": -1})]:
        with pytest.raises(InvalidRequestError) as e:
            engine.generate([[1, 2, 3]], SamplingParams(**kwargs))
        assert e.value.field == field


def test_the_first_tokens_logprobs_cross_with_the_kv() -> None:
    meta = PrefilledKV(7, 0, None, TokenLogprobs(-0.25, ((7, -0.25), (9, -1.5)))).to_meta()
    assert PrefilledKV.from_meta(meta).first_logprobs == TokenLogprobs(-0.25, ((7, -0.25), (9, -1.5)))
    assert PrefilledKV.from_meta(PrefilledKV(7, 0).to_meta()).first_logprobs is None


def test_a_migrated_request_continues_exactly(engine: Engine) -> None:
    """What the Conductor does on a move (conductor/migration.py): prompt + the tokens sent,
    `output_offset` = how many; with penalties and min_tokens the rest is the undisturbed run's."""
    prompt = engine.tokenizer.encode("one two three one two three one two")
    params = SamplingParams(max_tokens=10, frequency_penalty=1.1, presence_penalty=0.2, min_tokens=6,
                            logit_bias={2: 3.0})
    whole = engine.generate([prompt], params)[0].output_ids
    progress = Progress(GenerationInput(prompt, params), 0.0)
    progress.sent = whole[:4]
    moved = progress.next_input()
    assert moved.params.output_offset == 4 and moved.prompt_ids == prompt + whole[:4]
    assert engine.generate([moved.prompt_ids], moved.params)[0].output_ids == whole[4:]


def test_prompt_logprobs_equal_transformers_even_for_a_cached_prefix(engines: Engine, hf: Any) -> None:
    """Every prompt token after the first, computed in the prefill (chunked: a 40-token budget
    splits the long prompt), its prefix cached by an earlier request: recomputed, not skipped."""
    text = "The quick brown fox jumps over the lazy dog. " * 6
    prompt = engines.tokenizer.encode(text)
    engines.generate([prompt], SamplingParams(max_tokens=1))  # caches its prefix blocks
    budget = engines.scheduler.max_num_batched_tokens
    engines.scheduler.max_num_batched_tokens = 40
    try:
        result = engines.generate([prompt], SamplingParams(max_tokens=3, prompt_logprobs=4, logprobs=2))[0]
    finally:
        engines.scheduler.max_num_batched_tokens = budget
    assert result.num_cached_tokens == 0  # the cached prefix was computed again, for its logits
    assert_prompt_logprobs(hf_logprobs(hf, prompt), prompt, result.prompt_logprobs, 4)
    assert result.logprobs is not None and len(result.logprobs) == 3


def test_prompt_logprobs_survive_a_one_token_chunk(engine: Engine) -> None:
    """A 39-token prompt ahead in a 40-token step leaves the next prompt one token: that chunk
    is laid out as a decode row, and its prompt logprob must still be taken (a missed row once
    dropped every later one)."""
    ahead = list(range(100, 139))
    asking = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog again and again")
    alone = engine.generate([asking], SamplingParams(max_tokens=2, prompt_logprobs=2))[0].prompt_logprobs
    budget = engine.scheduler.max_num_batched_tokens
    engine.scheduler.max_num_batched_tokens = 40
    try:
        _, packed = engine.generate([ahead, asking], [SamplingParams(max_tokens=2),
                                                      SamplingParams(max_tokens=2, prompt_logprobs=2)])
    finally:
        engine.scheduler.max_num_batched_tokens = budget
    assert alone is not None and packed.prompt_logprobs is not None and len(alone) == len(asking) - 1
    assert [round(a.logprob, 4) for a in packed.prompt_logprobs] == [round(a.logprob, 4) for a in alone]


def test_a_moved_request_does_not_ask_prompt_logprobs_again() -> None:
    params = SamplingParams(max_tokens=6, prompt_logprobs=2, logprobs=1)
    progress = Progress(GenerationInput([5, 6, 7], params), 0.0)
    progress.sent = [8, 9]
    moved = progress.next_input().params
    assert moved.prompt_logprobs is None and moved.logprobs == 1 and moved.output_offset == 2
