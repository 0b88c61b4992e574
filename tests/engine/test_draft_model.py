"""A draft model as the draft source (`--speculative draft:MODEL`, engine/draft_model.py): output
token-identical to decoding without speculation (greedy and seeded sampling), with a draft that
agrees with the target (SmolLM2 drafting for itself: nearly every draft accepted) and one that
does not (a tiny random-weight model), also when requests prefill in the steps where others
verify drafts (staggered arrivals, with preemption); a draft with another vocabulary is refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from halfmoon.core.params import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.engine.errors import UnsupportedModelError
from tests.conftest import EngineFactory
from tests.engine.staggered_support import staggered
from tests.model_families import BY_NAME, build_checkpoint

pytestmark = [pytest.mark.timeout(300)]
QUOTING = ("Repeat this sentence exactly, twice: The committee approved the budget for the new library "
           "on Tuesday evening after a long debate.\nAnswer:")
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,")


def outputs(engine: Engine, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    return [r.output_ids for r in engine.generate(ids, params)]


def test_a_draft_that_agrees_with_the_target_is_accepted_and_changes_nothing(
        make_engine: EngineFactory, shared_engine: Engine) -> None:
    spec = make_engine(num_blocks=128, speculative="draft:smollm2")
    greedy = SamplingParams(max_tokens=32, ignore_eos=True)
    assert outputs(spec, greedy) == outputs(shared_engine, greedy)
    stats = spec.speculator.stats
    assert stats.proposed > 30 and stats.acceptance > 0.9, stats
    sampled = [SamplingParams(max_tokens=24, temperature=0.8, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    assert outputs(spec, sampled) == outputs(shared_engine, sampled)
    spec.pool.check_integrity()
    proposer = spec.speculator.proposer
    assert proposer.pool.num_free() == proposer.pool.num_blocks  # every draft state was let go


def test_a_draft_that_disagrees_changes_nothing_either(make_engine: EngineFactory, shared_engine: Engine,
                                                       tmp_path: Path) -> None:
    tiny = dataclasses.replace(BY_NAME["llama"], kwargs={**BY_NAME["llama"].kwargs, "vocab_size": 49152})
    build_checkpoint(tiny, tmp_path / "tiny")  # random weights over SmolLM2's vocabulary
    spec = make_engine(num_blocks=128, speculative=f"draft:{tmp_path / 'tiny'}")
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    assert outputs(spec, greedy) == outputs(shared_engine, greedy)
    assert spec.speculator.stats.proposed > 0 and spec.speculator.stats.acceptance < 0.5
    spec.pool.check_integrity()


def test_a_draft_with_another_vocabulary_is_refused(make_engine: EngineFactory) -> None:
    with pytest.raises(UnsupportedModelError, match="vocabulary"):
        make_engine(num_blocks=16, speculative="draft:gemma3-270m")


def test_the_mode_is_validated() -> None:
    from halfmoon.core.errors import ConfigError  # noqa: PLC0415

    with pytest.raises(ConfigError, match="draft:MODEL"):
        EngineConfig(speculative="draft:")
    assert EngineConfig(speculative="draft:smollm2").speculative == "draft:smollm2"


@pytest.mark.parametrize("draft, num_blocks", [("tiny", 10), ("smollm2", 128)])
def test_requests_arriving_while_others_draft_are_unchanged(make_engine: EngineFactory, shared_engine: Engine,
                                                            tmp_path: Path, draft: str, num_blocks: int) -> None:
    """Staggered arrivals: requests prefill in the steps where others verify a draft model's
    drafts. Such a step once placed the prefill chunk after the decode requests instead of their
    rows (engine/runner.py), and both got wrong tokens: the prefilling request from its first
    token (seen with the random draft), the verifying one wherever a draft was accepted (SmolLM2
    drafting for itself). With 10 blocks the tiny draft's run also preempts a drafting request."""
    if draft == "tiny":
        tiny = dataclasses.replace(BY_NAME["llama"], kwargs={**BY_NAME["llama"].kwargs, "vocab_size": 49152})
        build_checkpoint(tiny, tmp_path / "tiny")
        draft = str(tmp_path / "tiny")
    spec = make_engine(num_blocks=num_blocks, speculative=f"draft:{draft}")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [shared_engine.tokenizer.encode(p) for p in (QUOTING, *PROMPTS)]
    expected = [r.output_ids for r in shared_engine.generate(prompts, params)]
    got, mixed = staggered(spec, prompts, params)
    assert got == expected
    assert mixed > 0 and spec.speculator.stats.proposed > 0
    assert (spec.scheduler.stats.preemptions > 0) == (num_blocks == 10)
    spec.pool.check_integrity()
