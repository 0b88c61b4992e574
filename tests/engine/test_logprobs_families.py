"""Logprobs and logit processing (issue 46) on two tiny random-weight families against
transformers' own forward in fp32 (tests/model_families.py): Gemma 3 (sliding windows shorter
than the prompts, local/global RoPE, tied embeddings) and Qwen2 (q/k/v biases, a sliding first
layer, YaRN RoPE). Each runs as

    local          one engine                      local-ngram / local-draft   with speculation
    1p1d           prefill worker -> decode worker (in process, KV over loopback tcp; the first
                   token and its logprobs are the prefill worker's and cross with the KV)
    1p1d-ngram     the same, the decode worker speculating
    tp2 / tp2-ngram  one engine over two ranks (gloo): logits gathered from vocab shards

and every mode checks, on prompts chunked by a 32-token step budget:
* each output token's logprob and top-5 equal transformers' log_softmax within 2e-3 (speculative
  modes: some drafts were accepted, so verification rows were reported);
* prompt logprobs of every prompt token after the first, for a prompt whose first two blocks a
  request before it cached (recomputed for their logits, not skipped);
* penalties, biases and min_tokens: greedy tokens follow a reference implementation of the
  formula on transformers' logits (tests/engine/logprobs_support.py), and the logprobs reported
  are still the model's own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from halfmoon.conductor.cluster_config import ClusterConfig
from halfmoon.core.params import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.engine.loader import load_weights
from halfmoon.engine.outputs import CompletionResult, completion_result
from tests.conftest import NUM_THREADS, assert_engine_idle
from tests.engine.logprobs_support import (penalty_cases, assert_follows_reference, assert_logprobs, assert_prompt_logprobs,
                                           hf_logprobs)
from tests.model_families import BY_NAME, build_checkpoint, prompts
from tests.workers_support import TIMEOUT_S, TRANSPORT, InProcessWorkers, run_pair, settled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FAMILIES = ("gemma3", "qwen2")
MODES = ("local", "local-ngram", "local-draft", "1p1d", "1p1d-ngram", "tp2", "tp2-ngram")
NEW = 16
BUDGET = 32  # tokens a step: the 40-token prompts are prefilled in two chunks
EOS = 2
# two random prompts and two that repeat (n-gram drafts find matches in them)
PROMPTS = [*prompts(2), [5 + (i % 7) for i in range(40)], [9 + (i % 5) for i in range(33)]]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    folder: Path
    model: Any  # the transformers model the folder holds (fp32, eager attention)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("logprobs-families")
    return {name: Checkpoint(root / name, build_checkpoint(BY_NAME[name], root / name)) for name in FAMILIES}


class Target:
    """One family in one mode: `generate` as `Engine.generate`, `engine` the decoding engine."""

    engine: Engine

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[CompletionResult]:
        raise NotImplementedError

    def accepted(self) -> int:
        """Drafts accepted so far (0 without speculation)."""
        return self.engine.speculator.stats.accepted if self.engine.speculator is not None else 0

    def assert_idle(self) -> None:
        assert_engine_idle(self.engine)

    def close(self) -> None:
        self.engine.close()


class Local(Target):
    def __init__(self, folder: Path, **overrides: Any) -> None:
        self.engine = Engine(engine_config(folder, **overrides))

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[CompletionResult]:
        return self.engine.generate(prompt_ids, params)


class Pair(Target):
    """A prefill worker and a decode worker in this process; requests go through both at once,
    as the Conductor sends them."""

    def __init__(self, folder: Path, **overrides: Any) -> None:
        config = ClusterConfig(engine=engine_config(folder, **overrides), transport=TRANSPORT,
                               request_timeout_s=TIMEOUT_S)
        self.workers = InProcessWorkers(config, load_weights(str(folder), torch.float32))
        self.workers.start(None)
        self.engine = self.workers.decode.engine
        self.ids = itertools.count()

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[CompletionResult]:
        rids = [f"r{next(self.ids)}" for _ in prompt_ids]

        async def run() -> list[Any]:
            return await asyncio.gather(*(run_pair(self.workers.prefill, self.workers.decode, rid, ids, params)
                                          for rid, ids in zip(rids, prompt_ids)))

        results = []
        for rid, ids, (prefilled, chunks) in zip(rids, prompt_ids, asyncio.run(run())):
            result = completion_result(rid, ids, chunks)
            assert result.output_ids[0] == prefilled.first_token  # sampled on the prefill worker
            result.num_cached_tokens = prefilled.num_cached_tokens  # what the Conductor reports
            results.append(result)
        return results

    def assert_idle(self) -> None:
        assert asyncio.run(settled([self.workers.prefill, self.workers.decode])) == []

    def close(self) -> None:
        self.workers.stop()


def engine_config(folder: Path, **overrides: Any) -> EngineConfig:
    return EngineConfig(**{"model": str(folder), "dtype": "float32", "num_blocks": 96, "num_threads": NUM_THREADS,
                           "max_num_batched_tokens": BUDGET, "speculative_max_batch": 8, **overrides})


def make_target(mode: str, folder: Path) -> Target:
    speculative = {"ngram": "ngram", "draft": f"draft:{folder}"}.get(mode.split("-")[-1], "off")
    if mode.startswith("1p1d"):
        return Pair(folder, speculative=speculative)
    return Local(folder, speculative=speculative, tp=2 if mode.startswith("tp2") else 1)


@dataclass(frozen=True, slots=True)
class Case:
    target: Target
    family: str
    mode: str
    model: Any


@pytest.fixture(scope="module", params=list(itertools.product(FAMILIES, MODES)), ids="-".join)
def case(request: pytest.FixtureRequest, checkpoints: dict[str, Checkpoint]) -> Iterator[Case]:
    family, mode = request.param
    target = make_target(mode, checkpoints[family].folder)
    try:
        yield Case(target, family, mode, checkpoints[family].model)
    finally:
        target.close()


@pytest.fixture
def target(case: Case) -> Iterator[Target]:
    """The case's target, idle before and after the test."""
    case.target.assert_idle()
    yield case.target
    case.target.assert_idle()


def test_logprobs_equal_transformers_log_softmax(case: Case, target: Target) -> None:
    accepted = target.accepted()
    results = target.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=5))
    for prompt, result in zip(PROMPTS, results):
        assert len(result.output_ids) == NEW
        assert_logprobs(hf_logprobs(case.model, prompt + result.output_ids), prompt, result.output_ids,
                        result.logprobs, 5)
    if case.mode.endswith(("ngram", "draft")):
        assert target.accepted() > accepted, "no draft was accepted: no verification row was checked"


def test_prompt_logprobs_of_a_cached_prefix_equal_transformers(case: Case, target: Target) -> None:
    """A prompt sharing two cached blocks (32 tokens) with an earlier one: the cache would serve
    them (a request without prompt logprobs gets them), but prompt logprobs need their logits."""
    first, other = PROMPTS[0], PROMPTS[1]
    target.generate([first], SamplingParams(max_tokens=2))  # caches its two full blocks
    probe = target.generate([first[:32] + other[:5]], SamplingParams(max_tokens=2))[0]
    assert probe.num_cached_tokens == 32, probe.num_cached_tokens
    prompt = first[:32] + other[:12]
    result = target.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3,
                                                      prompt_logprobs=5))[0]
    assert result.num_cached_tokens == 0  # computed again, for its logits
    rows = hf_logprobs(case.model, prompt + result.output_ids)
    assert_prompt_logprobs(rows, prompt, result.prompt_logprobs, 5)
    assert_logprobs(rows, prompt, result.output_ids, result.logprobs, 3)


PENALTIES = penalty_cases(NEW)


@pytest.mark.parametrize("name", sorted(PENALTIES))
def test_penalties_and_bias_follow_the_reference(case: Case, target: Target, name: str) -> None:
    params = dataclasses.replace(PENALTIES[name], logprobs=2)
    check_against_the_reference(case, target.generate(PROMPTS, params), params)


# EOS's bias per family (the families' logits spread ~1 and ~4): EOS then comes within a few
# tokens without min_tokens (at 1-8), and soon after the 6 that min_tokens holds it back
EOS_BIAS = {"gemma3": 4.0, "qwen2": 10.0}
MIN_TOKENS = 6


def test_min_tokens_holds_eos_back_as_the_reference_does(case: Case, target: Target) -> None:
    biased = SamplingParams(max_tokens=NEW, logit_bias={EOS: EOS_BIAS[case.family]}, frequency_penalty=0.5,
                            logprobs=2)
    held = dataclasses.replace(biased, min_tokens=MIN_TOKENS)
    early, late = target.generate(PROMPTS, biased), target.generate(PROMPTS, held)
    check_against_the_reference(case, early, biased)
    check_against_the_reference(case, late, held)
    assert any(len(r.output_ids) <= MIN_TOKENS for r in early), [r.output_ids for r in early]
    assert all(r.output_ids[-1] == EOS and len(r.output_ids) > MIN_TOKENS for r in late), \
        [r.output_ids for r in late]


def check_against_the_reference(case: Case, results: list[CompletionResult], params: SamplingParams) -> None:
    """Greedy tokens as the reference processing gives them; logprobs the model's own, unprocessed."""
    for prompt, result in zip(PROMPTS, results):
        assert_follows_reference(case.model, prompt, params, case.target.engine.stop_ids, result.output_ids)
        rows = hf_logprobs(case.model, prompt + result.output_ids)
        assert_logprobs(rows, prompt, result.output_ids, result.logprobs, 2, greedy=False)
