"""Constrained decoding in the engine (engine/grammar.py): every output that ends with `stop`
satisfies its constraint, sampled at temperature 0.9 over many seeds, with and without n-gram
speculation; a resumed (migrated) request and a prefilled one continue from their token history."""

from __future__ import annotations

import json

import pytest

from halfmoon.core.params import Constraint, ConstraintKind, FinishReason, SamplingParams
from halfmoon.engine.engine import Engine
from tests.conftest import EngineFactory, assert_engine_idle
from tests.engine.constraint_cases import PROMPTS, SCHEMAS, all_cases, check, schema_constraint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SEEDS = 8  # choices per case (n = 8 from one prefill: seeds s .. s + 7)


def chat(engine: Engine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


@pytest.fixture(scope="module")
def speculating(make_engine: EngineFactory) -> Engine:
    return make_engine(num_blocks=256, speculative="ngram")


def _sample_all(engine: Engine, seed: int) -> dict[str, list[tuple[str, FinishReason]]]:
    out = {}
    for name, constraint in all_cases():
        params = SamplingParams(max_tokens=120, temperature=0.9, seed=seed, n=SEEDS, constraint=constraint)
        results = engine.generate_choices(chat(engine, PROMPTS[name]), params)
        out[name] = [(r.text, r.finish_reason) for r in results]
    return out


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "ngram"])
def test_every_stopped_output_satisfies_its_constraint(engine: Engine, speculating: Engine, spec: bool) -> None:
    target = speculating if spec else engine
    outputs = _sample_all(target, seed=11)
    stopped = 0
    for name, results in outputs.items():
        for text, reason in results:
            if reason is FinishReason.STOP:
                check(name, text)
                stopped += 1
    assert stopped >= 0.8 * SEEDS * len(outputs), outputs  # a few may run out of max_tokens
    assert_engine_idle(target)


def test_speculation_changes_no_greedy_constrained_output(engine: Engine, speculating: Engine) -> None:
    """Drafts are checked against the grammar and rolled back: greedy output is the same."""
    for name, constraint in all_cases():
        params = SamplingParams(max_tokens=80, constraint=constraint)
        prompt = chat(engine, PROMPTS[name])
        plain, spec = engine.generate([prompt], params)[0], speculating.generate([prompt], params)[0]
        assert (spec.output_ids, spec.finish_reason) == (plain.output_ids, plain.finish_reason), name
    assert speculating.speculator is not None and speculating.speculator.stats.proposed > 0


def test_a_resumed_request_continues_from_its_outputs(engine: Engine) -> None:
    """A migrated request resumes with its outputs inside its prompt (output_offset): its
    matcher catches up with them, and the whole output is the uninterrupted one."""
    prompt, constraint = chat(engine, PROMPTS["person"]), schema_constraint("person")
    whole = engine.generate([prompt], SamplingParams(max_tokens=100, constraint=constraint))[0]
    assert whole.finish_reason is FinishReason.STOP, whole.text
    cut = 9
    resumed = engine.generate([prompt + whole.output_ids[:cut]],
                              SamplingParams(max_tokens=100 - cut, constraint=constraint, output_offset=cut))[0]
    assert whole.output_ids[:cut] + resumed.output_ids == whole.output_ids
    check("person", whole.text)


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(engine: Engine) -> None:
    choice = Constraint(ConstraintKind.CHOICE, json.dumps(["yes", "no"]))
    out = engine.generate([chat(engine, "Yes or no?")], SamplingParams(max_tokens=30, ignore_eos=True,
                                                                       constraint=choice))[0]
    assert out.finish_reason is FinishReason.STOP and out.text in ("yes", "no")


def test_max_tokens_mid_structure_ends_with_length(engine: Engine) -> None:
    out = engine.generate([chat(engine, PROMPTS["order"])],
                          SamplingParams(max_tokens=5, constraint=schema_constraint("order")))[0]
    assert out.finish_reason is FinishReason.LENGTH and out.text.startswith("{")


def test_min_tokens_never_blocks_a_grammar_that_must_end(engine: Engine) -> None:
    """min_tokens holds EOS back, but a complete grammar allows only EOS: the constraint wins."""
    choice = Constraint(ConstraintKind.CHOICE, json.dumps(["ok"]))
    out = engine.generate([chat(engine, "Say ok.")], SamplingParams(max_tokens=20, min_tokens=10,
                                                                    constraint=choice))[0]
    assert out.text == "ok" and out.finish_reason is FinishReason.STOP


def test_constraints_mix_with_free_requests_in_one_batch(engine: Engine) -> None:
    """A constrained request's mask touches only its own rows."""
    prompt = chat(engine, PROMPTS["person"])
    free = SamplingParams(max_tokens=24, ignore_eos=True)
    alone = engine.generate([prompt], free)[0]
    mixed = engine.generate([prompt, prompt], [free, SamplingParams(max_tokens=60, constraint=schema_constraint("person"))])
    assert mixed[0].output_ids == alone.output_ids
    check("person", mixed[1].text)
    assert set(SCHEMAS) >= {"person"}
