"""Constrained decoding: a request's output kept inside a JSON schema, regex, choice or grammar.

The grammar engine is llguidance (chosen over xgrammar by measurement, docs/ARCHITECTURE.md
"Constrained decoding"): it names the schema keywords it does not implement, which a request is
refused for (400 naming them, never an unconstrained answer), and it compiles a schema in about
a millisecond. Its parts here:

    Grammars (one per engine)     the tokenizer's LLTokenizer (built once) and a bounded LRU of
                                  compiled constraints; `compile` validates and is the slow part
                                  (callers run it off the event loop and off the engine thread)
    ConstraintState (per request) its matcher and how many of its tokens it consumed: it
                                  *catches up* with the request's token history, so a decode
                                  worker given a prefilled request, a migrated request (its
                                  outputs in its prompt) and a fork all continue from their
                                  tokens, with no matcher state shipped anywhere
    step_bitmask / apply_bitmask  one step's allowed tokens, one row per sampled logits row
                                  (a verification's row j after its first j drafts), computed
                                  while the model runs its forward pass (engine/runner.py) and
                                  applied after every other logit processing (engine/logits.py)
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import llguidance as llg
import torch

from halfmoon.core.errors import InvalidRequestError
from halfmoon.core.params import Constraint, ConstraintKind, SamplingParams
from halfmoon.engine.tokenizer import Tokenizer
from halfmoon.kernels.token_mask import mask_logits

if TYPE_CHECKING:
    from halfmoon.engine.request import Request

log = logging.getLogger(__name__)

# Whitespace as json.dumps writes it: ", " and ": ", no newlines or indentation. A small model
# let loose on "any whitespace" can pad forever; one layout is also what clients parse.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = '{"type": "object"}'
CACHE_SIZE = 256  # compiled constraints kept per engine
MAX_MESSAGE = 400  # characters of the grammar engine's complaint a client sees


class UnsupportedConstraintError(InvalidRequestError):
    """The grammar engine cannot hold an output to this constraint (an unimplemented schema
    keyword, an invalid regex or grammar): refused, never answered unconstrained."""


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_VALUES = ("enum", "const", "default", "examples", "required")


def _strict_keyword(key: str, value: Any) -> Any:
    if key in _VALUES:
        return value
    if key in _SCHEMA_MAPS and isinstance(value, dict):
        return {name: strict_objects(v) for name, v in value.items()}
    return strict_objects(value)


def strict_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` wherever an object lists its properties
    and says nothing of others (xgrammar's strict mode): what it accepts still validates against
    the original, and a small model cannot pad an answer with invented keys."""
    if isinstance(schema, list):
        return [strict_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict_keyword(k, v) for k, v in schema.items()}
    if "properties" in out and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & set(out):
        out["additionalProperties"] = False
    return out


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar for a constraint (not yet checked)."""
    kind, spec = constraint.kind, constraint.spec
    if kind is ConstraintKind.JSON:
        return llg.LLMatcher.grammar_from_json_schema(ANY_OBJECT, defaults=JSON_OPTIONS)
    if kind is ConstraintKind.JSON_SCHEMA:
        return llg.LLMatcher.grammar_from_json_schema(_strict_text(spec), defaults=JSON_OPTIONS)
    if kind is ConstraintKind.REGEX:
        return llg.LLMatcher.grammar_from_regex(spec)
    if kind is ConstraintKind.CHOICE:
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in _choices(spec)))
    return llg.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark


def _strict_text(spec: str) -> str:
    try:
        schema = json.loads(spec)
    except ValueError:
        return spec  # the grammar engine names what is wrong with it
    return json.dumps(strict_objects(schema))


def _choices(spec: str) -> list[str]:
    try:
        choices = json.loads(spec)
    except ValueError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise UnsupportedConstraintError("constraint", "a choice is a non-empty list of non-empty strings")
    return choices


class Compiled:
    """A constraint checked against one tokenizer: a matcher in its start state to copy."""

    __slots__ = ("template",)

    def __init__(self, template: llg.LLMatcher) -> None:
        self.template = template


class Grammars:
    """One engine's (or front door's) grammar compiler: thread-safe, bounded, per tokenizer."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: Collection[int] = (),
                 cache_size: int = CACHE_SIZE) -> None:
        """`stop_ids`: the tokens that end a request (the tokenizer's and the model's): the end
        of a grammar (default: the tokenizer's)."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids or tokenizer.stop_ids)
        self._ll: llg.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[Constraint, Compiled] = OrderedDict()
        self._size = cache_size

    @property
    def ll_tokenizer(self) -> llg.LLTokenizer:
        """Built on first use (~0.2 s for a 49k vocabulary), then shared by every matcher."""
        with self._lock:
            if self._ll is None:
                self._ll = llg.LLTokenizer(self._tokenizer.to_json(), n_vocab=self.vocab_size,
                                           eos_token=self.stop_ids)
            return self._ll

    def compile(self, constraint: Constraint) -> Compiled:
        """The constraint compiled (cached); UnsupportedConstraintError when it cannot be held."""
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
                return hit
        compiled = self._compile(constraint)
        with self._lock:
            self._cache[constraint] = compiled
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, constraint: Constraint) -> Compiled:
        constraint.validate()
        grammar = grammar_text(constraint)
        tokenizer = self.ll_tokenizer
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error or messages:  # a warning is a keyword ignored: never serve that unconstrained
            raise UnsupportedConstraintError("constraint", _describe(constraint.kind, messages))
        matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise UnsupportedConstraintError("constraint", _describe(constraint.kind, [matcher.get_error()]))
        return Compiled(matcher)

    def state(self, constraint: Constraint, first_output: int) -> ConstraintState:
        """A fresh matcher for one request (or choice) whose outputs start at `first_output`
        in its token ids."""
        return ConstraintState(self.compile(constraint).template.deep_copy(), first_output, self.stop_ids)

    async def prepare(self, params: SamplingParams) -> None:
        """Compile a request's constraint (if any) on a thread: neither the event loop nor the
        engine thread waits for it (the engine then finds it in the cache)."""
        if params.constraint is not None:
            await asyncio.to_thread(self.compile, params.constraint)

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)


def _describe(kind: ConstraintKind, messages: Sequence[str]) -> str:
    """The grammar engine's messages on one line (a regex error spans several), bounded."""
    text = "; ".join(" ".join(m.split()) for m in messages if m.strip()) or "rejected by the grammar engine"
    return f"this {kind.value} cannot be enforced: {text[:MAX_MESSAGE]}"


class ConstraintState:
    """A request's matcher, caught up with its token history (engine thread, or the runner's
    mask thread while the engine waits for it)."""

    __slots__ = ("matcher", "counted", "stop_ids", "error")

    def __init__(self, matcher: llg.LLMatcher, first_output: int, stop_ids: Collection[int]) -> None:
        self.matcher = matcher
        self.counted = first_output  # token_ids[:counted] are consumed (or the prompt)
        self.stop_ids = list(stop_ids)
        self.error: str | None = None

    def catch_up(self, token_ids: Sequence[int]) -> None:
        """Consume the outputs not seen yet; a token the grammar refuses sets `error`."""
        if self.counted >= len(token_ids) or self.error is not None:
            return
        new = list(token_ids[self.counted :])
        self.counted = len(token_ids)
        if not self.matcher.consume_tokens(new):
            self.error = self.matcher.get_error() or f"tokens {new} left the grammar"

    @property
    def complete(self) -> bool:
        """The grammar is done (its end token consumed); nothing may follow."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def fill_rows(self, bitmask: torch.Tensor, first: int, draft: Sequence[int]) -> None:
        """Rows `first .. first + len(draft)` of `bitmask`: row j allows what may follow the
        history and `draft[:j]`. Rows after a draft the grammar refuses copy the row before
        (never sampled from: acceptance stops at that draft, whose row cannot pick it)."""
        m = self.matcher
        self._fill(bitmask, first)
        ok = m.validate_tokens(list(draft)) if draft else 0
        for j in range(1, len(draft) + 1):
            if j <= ok:
                m.consume_token(draft[j - 1])
                self._fill(bitmask, first + j)
            else:
                bitmask[first + j] = bitmask[first + j - 1]
        if ok:
            m.rollback(ok)

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        view = bitmask[row]
        if self.error is None and not self.matcher.is_error():
            self.matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())
            if bool(view.any()):
                return
        view.zero_()  # a broken matcher allows only the end: the request stops, its error logged
        for t in self.stop_ids:
            view[t // 32] |= _bit(t % 32)


def _bit(i: int) -> int:
    """Bit i of an int32 word, as a Python int that fits an int32 tensor element."""
    return -(1 << 31) if i == 31 else 1 << i


def step_bitmask(requests: Sequence[Request], drafts: Sequence[Sequence[int]] | None, spans: Sequence[tuple[int, int]],
                 vocab_size: int) -> torch.Tensor | None:
    """The step's bitmask, one int32 row of `ceil(vocab / 32)` words per sampled logits row (all
    ones for an unconstrained request's rows); None when no request is constrained."""
    constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not constrained:
        return None
    rows = spans[-1][0] + spans[-1][1]
    bitmask = torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for i in constrained:
        state = requests[i].grammar
        state.catch_up(requests[i].token_ids)
        state.fill_rows(bitmask, spans[i][0], drafts[i] if drafts is not None else ())
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """-inf, in place, on every token a row's bitmask leaves out (only `rows` are touched; row r
    of the logits takes row r of the bitmask)."""
    mask_logits(logits, bitmask, rows, rows)
