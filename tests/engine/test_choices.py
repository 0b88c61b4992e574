"""n > 1 (SamplingParams.n) on the engine: one prefill, choices forked from the prompt's blocks
(the full ones shared, the partial last one copied), each with its own generator.

Choice i of a seeded request equals a single request of seed `seed + i`; greedy choices equal
the greedy answer; an abort ends every choice; the pool ends as it started."""

from __future__ import annotations

import pytest

from halfmoon.core.errors import InvalidRequestError
from halfmoon.core.messages import PrefilledKV
from halfmoon.core.params import FinishReason, SamplingParams
from halfmoon.engine.engine import Engine
from halfmoon.engine.kv_push import prefilled_kv
from halfmoon.engine.outputs import completion_result
from tests.conftest import EngineFactory, assert_engine_idle

pytestmark = pytest.mark.timeout(300)
PROMPT = "Once upon a time, in a village by the sea, there lived"  # not a multiple of the block size


@pytest.fixture(scope="module")
def engine(shared_engine: Engine) -> Engine:
    return shared_engine


def _ids(engine: Engine) -> list[int]:
    ids = engine.tokenizer.encode(PROMPT)
    assert len(ids) % engine.config.block_size, "the test wants a partial last block"
    return ids


def test_seeded_choices_equal_single_requests_of_their_seeds(engine: Engine) -> None:
    prompt = _ids(engine)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, n=4, ignore_eos=True,
                            logprobs=2)
    before = engine.scheduler.stats.prompt_tokens_computed
    choices = engine.generate_choices(prompt, params)
    assert engine.scheduler.stats.prompt_tokens_computed - before == len(prompt), "one prefill for four choices"
    again = engine.generate_choices(prompt, params)
    assert [c.output_ids for c in again] == [c.output_ids for c in choices]
    for i, choice in enumerate(choices):
        [single] = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95,
                                                            seed=1234 + i, ignore_eos=True, logprobs=2))
        assert choice.output_ids == single.output_ids, i
        assert choice.logprobs is not None and single.logprobs is not None
        assert [lp.top[0][0] for lp in choice.logprobs] == [lp.top[0][0] for lp in single.logprobs]
        assert choice.finish_reason is FinishReason.LENGTH
    assert len({tuple(c.output_ids) for c in choices}) > 1, "four seeds gave one answer: not sampling"
    assert_engine_idle(engine)


def test_greedy_choices_are_the_greedy_answer(engine: Engine) -> None:
    prompt = _ids(engine)
    [single] = engine.generate([prompt], SamplingParams(max_tokens=10))
    choices = engine.generate_choices(prompt, SamplingParams(max_tokens=10, n=3))
    assert [c.output_ids for c in choices] == [single.output_ids] * 3
    assert [c.text for c in choices] == [single.text] * 3
    assert_engine_idle(engine)


def test_usage_sums_the_choices_and_each_ends_on_its_own(engine: Engine) -> None:
    prompt = _ids(engine)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=7, ignore_eos=True))
    chunks = []
    while not chunks or not chunks[-1].finished:
        chunks.extend(engine.step())
    assert {c.request_id for c in chunks} == {rid}
    assert sorted({c.index for c in chunks}) == [0, 1, 2]
    ends = [c for c in chunks if c.choice_end is not None]
    assert sorted(c.index for c in ends) == [0, 1, 2]
    assert [c for c in chunks if c.end is not None] == [chunks[-1]]
    assert chunks[-1].end.usage.completion_tokens == sum(e.choice_end.completion_tokens for e in ends) == 18
    assert chunks[-1].end.usage.prompt_tokens == len(prompt)
    assert_engine_idle(engine)


def test_an_abort_ends_every_choice(engine: Engine) -> None:
    prompt = _ids(engine)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=200, n=3, ignore_eos=True))
    chunks = engine.step() + engine.step()
    engine.abort(rid)
    while not chunks or not chunks[-1].finished:
        chunks.extend(engine.step())
    ends = {c.index: c.choice_end.finish_reason for c in chunks if c.choice_end is not None}
    assert ends == {0: FinishReason.ABORT, 1: FinishReason.ABORT, 2: FinishReason.ABORT}
    assert_engine_idle(engine)


def test_an_abort_before_the_prefill_ends_the_unstarted_choices(engine: Engine) -> None:
    prompt = _ids(engine)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=5, n=2))
    engine.abort(rid)
    chunks = engine.step()
    assert sorted(c.index for c in chunks if c.choice_end is not None) == [0, 1]
    assert chunks[-1].finished
    assert_engine_idle(engine)


def test_choices_fork_from_a_prefilled_request(make_engine: EngineFactory, engine: Engine) -> None:
    """The decode side: one KV arrival, n first tokens from the prefill side's DONE."""
    prompt = _ids(engine)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=99, n=3, ignore_eos=True)
    want = engine.generate_choices(prompt, params)
    prefill = make_engine(num_blocks=64)
    try:
        rid = prefill.add_request(prompt, params)
        [req] = prefill._inbox
        children = list(req.forks or [])
        while req.num_output_tokens == 0:
            prefill.step()
        req.forks = children  # as a prefill-only request keeps them for its DONE
        kv = PrefilledKV.from_meta(prefilled_kv(req).to_meta())
        req.forks = None
        assert len(kv.choices) == 2
        decode = make_engine(num_blocks=64)
        blocks = decode.reserve_blocks(len(prompt))
        # the prompt's KV: the prefill engine's blocks copied into the decode engine's
        for src, dst in zip(req.block_table, blocks):
            decode.kv_cache[:, :, dst].copy_(prefill.kv_cache[:, :, src])
        rid = decode.add_prefilled(prompt, kv.first_token, params, blocks, generator_state=kv.generator_state,
                                   choices=kv.choices)
        chunks = []
        while not chunks or not chunks[-1].finished:
            chunks.extend(decode.step())
        got = [completion_result(rid, prompt, chunks, i).output_ids for i in range(3)]
        assert got == [w.output_ids for w in want]
        assert_engine_idle(decode)
    finally:
        prefill.abort(rid)
        while prefill.has_unfinished():
            prefill.step()


def test_n_is_validated(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request([1, 2, 3], SamplingParams(n=0))
    assert e.value.field == "n"
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request([1, 2, 3], SamplingParams(n=2, seed=2**63 - 1))
    assert e.value.field == "seed"


def test_choices_under_speculation_equal_plain_choices(make_engine: EngineFactory, engine: Engine) -> None:
    """n-gram speculation on the decode side: every choice's tokens as without it."""
    prompt = engine.tokenizer.encode("one two three one two three one two three one two")
    params = SamplingParams(max_tokens=10, temperature=0.7, seed=4, n=3, ignore_eos=True)
    want = engine.generate_choices(prompt, params)
    spec = make_engine(num_blocks=128, speculative="ngram", speculative_max_batch=8)
    assert [c.output_ids for c in spec.generate_choices(prompt, params)] == [w.output_ids for w in want]
    assert_engine_idle(spec)
