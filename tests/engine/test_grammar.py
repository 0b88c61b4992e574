"""engine/grammar.py on the real SmolLM2 tokenizer and llguidance: compile and cache, refusals
that name what cannot be enforced, a matcher catching up with a token history, bitmask rows for
a verification's drafts, and the mask applied to logits."""

from __future__ import annotations

import json

import pytest
import torch

from halfmoon.core.errors import InvalidRequestError
from halfmoon.core.params import Constraint, ConstraintKind, SamplingParams
from halfmoon.engine.engine import Engine
from halfmoon.engine.grammar import Grammars, UnsupportedConstraintError, apply_bitmask

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def grammars(shared_engine: Engine) -> Grammars:
    return Grammars(shared_engine.tokenizer, shared_engine.model_config.vocab_size, shared_engine.stop_ids,
                    cache_size=3)


def ids(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_bos=False)


def allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def test_compiles_once_and_the_cache_is_bounded(grammars: Grammars) -> None:
    first = grammars.compile(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    assert grammars.compile(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))) is first
    for i in range(5):
        grammars.compile(Constraint(ConstraintKind.REGEX, f"a{{{i + 1}}}"))
    assert len(grammars) == 3


@pytest.mark.parametrize("constraint, phrase", [
    (Constraint(ConstraintKind.JSON_SCHEMA, json.dumps({"type": "array", "uniqueItems": True})), "uniqueItems"),
    (Constraint(ConstraintKind.JSON_SCHEMA, json.dumps({"if": {"type": "string"}, "then": {}})), "if"),
    (Constraint(ConstraintKind.JSON_SCHEMA, json.dumps({"type": "string", "format": "bogus"})), "bogus"),
    (Constraint(ConstraintKind.JSON_SCHEMA, json.dumps({"type": "string", "minLength": 5, "maxLength": 2})),
     "Unsatisfiable"),
    (Constraint(ConstraintKind.REGEX, "a(b"), "unclosed group"),
    (Constraint(ConstraintKind.GRAMMAR, "start: ("), "cannot be enforced"),
    (Constraint(ConstraintKind.CHOICE, json.dumps([])), "non-empty"),
    (Constraint(ConstraintKind.CHOICE, "not json"), "non-empty"),
])
def test_what_cannot_be_enforced_is_refused_by_name(grammars: Grammars, constraint: Constraint, phrase: str) -> None:
    with pytest.raises(UnsupportedConstraintError) as refused:
        grammars.compile(constraint)
    assert refused.value.field == "constraint" and phrase in refused.value.message
    assert isinstance(refused.value, InvalidRequestError)  # a 400


def test_an_empty_spec_is_refused_by_shape() -> None:
    with pytest.raises(InvalidRequestError, match="needs its text"):
        SamplingParams(constraint=Constraint(ConstraintKind.REGEX, "")).validate(100)


def test_a_matcher_catches_up_with_history_and_ends(grammars: Grammars, shared_engine: Engine) -> None:
    """Outputs start after the prompt; where the grammar may end or go on, EOS and the longer
    choice are both allowed; where nothing can follow, it is complete without an EOS."""
    prompt = [1, 2, 3]
    state = grammars.state(Constraint(ConstraintKind.CHOICE, json.dumps(["yes", "yes sir"])), len(prompt))
    tokens = prompt + ids(shared_engine, "yes")
    state.catch_up(tokens)
    assert state.error is None and not state.complete
    bitmask = torch.zeros(1, (shared_engine.model_config.vocab_size + 31) // 32, dtype=torch.int32)
    state.fill_rows(bitmask, 0, ())
    sir = ids(shared_engine, "yes sir")[len(ids(shared_engine, "yes"))]
    assert allowed(bitmask, 0, shared_engine.tokenizer.eos_id) and allowed(bitmask, 0, sir)
    assert not allowed(bitmask, 0, ids(shared_engine, "no")[0])
    state.catch_up([*tokens, *ids(shared_engine, " sir")])
    assert state.complete and state.error is None


def test_a_token_outside_the_grammar_is_an_error_not_a_crash(grammars: Grammars, shared_engine: Engine) -> None:
    state = grammars.state(Constraint(ConstraintKind.CHOICE, json.dumps(["yes"])), 0)
    state.catch_up(ids(shared_engine, "no"))
    assert state.error is not None
    bitmask = torch.zeros(1, (shared_engine.model_config.vocab_size + 31) // 32, dtype=torch.int32)
    state.fill_rows(bitmask, 0, ())  # a broken matcher allows only the end
    on = [t for t in range(shared_engine.model_config.vocab_size) if allowed(bitmask, 0, t)]
    assert on and set(on) <= set(shared_engine.stop_ids)


def test_draft_rows_follow_the_drafts_and_roll_back(grammars: Grammars, shared_engine: Engine) -> None:
    """Row j allows what may follow draft[:j]; a refused draft's later rows copy the row before;
    the matcher is where it was afterwards."""
    state = grammars.state(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA)), 0)
    good = ids(shared_engine, '{"ok": true}')
    bad = ids(shared_engine, "zzz")[0]
    draft = [good[0], good[1], bad, good[2]]
    bitmask = torch.zeros(1 + len(draft), (shared_engine.model_config.vocab_size + 31) // 32, dtype=torch.int32)
    state.fill_rows(bitmask, 0, draft)
    assert allowed(bitmask, 0, good[0]) and allowed(bitmask, 1, good[1]) and not allowed(bitmask, 2, bad)
    assert torch.equal(bitmask[3], bitmask[2]) and torch.equal(bitmask[4], bitmask[2])
    again = torch.zeros_like(bitmask[:1])
    state.fill_rows(again, 0, ())
    assert torch.equal(again[0], bitmask[0]), "the drafts were rolled back"


def test_apply_bitmask_touches_only_its_rows() -> None:
    logits = torch.randn(3, 70)
    before = logits.clone()
    bitmask = torch.zeros(3, 3, dtype=torch.int32)
    bitmask[1, 0] = 0b101  # tokens 0 and 2
    bitmask[1, 2] = 1 << 1  # token 65
    apply_bitmask(logits, bitmask, [1])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    finite = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert finite == [0, 2, 65] and torch.equal(logits[1, finite], before[1, finite])


@pytest.mark.parametrize("vocab", [70, 49152, 49157])
def test_the_native_mask_equals_the_torch_one(vocab: int) -> None:
    """kernels/_fused.c mask_by_bits against the torch path: every word kind (all ones, all
    zeros, mixed), a vocabulary that is no multiple of 32, a subset of rows."""
    from halfmoon.kernels import token_mask

    if token_mask._fused is None:
        pytest.skip("kernels._fused is not built (no C compiler at install)")
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (8, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    bitmask[::3], bitmask[1::4] = 0, -1
    rows = [0, 1, 3, 6, 7]
    native, reference = logits.clone(), logits.clone()
    token_mask.mask_logits(native, bitmask, rows, rows)
    token_mask._mask_torch(reference, bitmask, rows, rows)
    assert torch.equal(native, reference) and torch.equal(native[2], logits[2])
