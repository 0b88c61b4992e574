"""Per-request sampling and stop parameters (validated when a request is added), and why a
request finished."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from halfmoon.core.adapters import AdapterRef
from halfmoon.core.errors import InvalidRequestError


GREEDY_EPS = 1e-5  # temperatures below this sample greedily (as vLLM does)


def check_token_ids(field: str, ids: Sequence[int], vocab_size: int) -> list[int]:
    """`ids` as a list; InvalidRequestError naming `field` when one is outside the vocabulary."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(field, f"ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return list(ids)


MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs
MAX_CHOICES = 64  # SamplingParams.n
FEATURES = ("logprobs", "logit_bias", "penalties", "min_tokens", "n", "constraint")  # SamplingParams.features
MAX_CONSTRAINT_CHARS = 256 * 1024  # a schema, regex, choice list or grammar, as text
PENALTY_LIMIT = 2.0  # |frequency_penalty|, |presence_penalty| (OpenAI's range)
BIAS_LIMIT = 100.0  # |logit_bias| values (OpenAI's range)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1.0 = off; seed None = random.

    Logit processing (engine/logits.py), in this order, before temperature / top-k / top-p:
    `logit_bias` (token id, bias) added; while fewer than `min_tokens` outputs, EOS and
    `stop_token_ids` are impossible and no stop string ends the request (vLLM's rule); `repetition_penalty` (HF's: a seen token's positive logit
    divided by it, a negative one multiplied; over prompt + outputs); `frequency_penalty` and
    `presence_penalty` (OpenAI's: `logit - count * frequency - (count > 0) * presence`, counts of
    the output tokens). `logprobs`: None = none; k = the sampled token's logprob and the k most
    likely (0..20), from the model's own distribution (log_softmax of the raw logits, before
    any processing or temperature). `prompt_logprobs`: the same for every prompt token after the
    first, computed during the prefill (such a request computes its whole prompt: no prefix
    cache hit, since a cached block keeps no logits). `output_offset`: how many trailing prompt tokens are in fact
    outputs (a migrated request resumes with its outputs in its prompt: they count as outputs
    for the penalties and min_tokens).

    `n`: choices from one prompt, prefilled (and in 1P1D transferred) once: the choices share
    the prompt's KV blocks and each samples on its own. Choice i's generator is seeded with
    `seed + i` (seeded requests: choice i equals a single request of seed `seed + i`); only
    choice 0 reports the prompt's logprobs.

    `constraint`: the output must match a JSON schema, regex, choice or grammar (`Constraint`);
    applied after every other logit processing (engine/grammar.py). Its request ends with `stop`
    once the grammar is complete (EOS is then the only token left), `ignore_eos` or not.

    `keep_special`: special tokens whose text the output keeps (decoding drops every other one):
    a tool-call marker that is a control token, as Mistral's `[TOOL_CALLS]`, which the front door
    reads the calls after.

    `adapter`: the LoRA adapter the request runs under (None = the base model), on its prefill
    and its decode worker alike (core/adapters.py); it roots the request's KV block hashes.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = field(default=())
    speculative: bool = True  # False: this request opts out of speculative decoding
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    output_offset: int = 0
    prompt_logprobs: int | None = None
    n: int = 1
    constraint: Constraint | None = None
    keep_special: tuple[int, ...] = ()
    adapter: AdapterRef | None = None
    # nothing beyond sampling: no logit processing, no logprobs (the step's fast path; set once
    # here, since the runner asks every request every step)
    plain: bool = field(init=False, repr=False, compare=False, default=True)

    def __post_init__(self) -> None:
        # Accept lists (and a dict of biases) from callers but keep the frozen object hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "keep_special", tuple(self.keep_special))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(k), float(v)) for k, v in bias)))
        object.__setattr__(self, "plain", self.logprobs is None and self.prompt_logprobs is None
                           and not self.processes_logits)

    @property
    def processes_logits(self) -> bool:
        """Whether any bias, penalty, min_tokens or constraint changes the logits before sampling."""
        return bool(self.logit_bias or self.frequency_penalty or self.presence_penalty
                    or self.repetition_penalty != 1.0 or self.min_tokens > self.output_offset
                    or self.constraint is not None)

    def choice(self, index: int) -> SamplingParams:
        """Choice `index`'s own parameters: one sequence, seeded `seed + index`, and the
        prompt's logprobs only on choice 0."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed, prompt_logprobs=self.prompt_logprobs if index == 0 else None)

    def features(self) -> tuple[str, ...]:
        """The sampling features this request uses beyond plain sampling (metrics count them)."""
        used = {"logprobs": self.logprobs is not None or self.prompt_logprobs is not None,
                "logit_bias": bool(self.logit_bias),
                "penalties": bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0),
                "min_tokens": self.min_tokens > 0, "n": self.n > 1, "constraint": self.constraint is not None}
        return tuple(name for name, on in used.items() if on)

    @property
    def greedy(self) -> bool:
        # Below this, temperature scaling overflows fp32 and the argmax is the answer anyway.
        return self.temperature < GREEDY_EPS

    def validate(self, vocab_size: int) -> None:
        """Raise `InvalidRequestError` naming the first bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature < math.inf:  # also rejects NaN
            raise InvalidRequestError("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError("seed", f"must be in [0, 2**63), got {self.seed}")
        check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)
        check_token_ids("keep_special", self.keep_special, vocab_size)
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must be non-empty")
        self._validate_processing(vocab_size)

    def _validate_processing(self, vocab_size: int) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:  # also rejects NaN
                raise InvalidRequestError(name, f"must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got {value}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise InvalidRequestError("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty}")
        check_token_ids("logit_bias", [k for k, _ in self.logit_bias], vocab_size)
        bad = [v for _, v in self.logit_bias if not -BIAS_LIMIT <= v <= BIAS_LIMIT]
        if bad:
            raise InvalidRequestError("logit_bias", f"values must be in [-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}], got {bad[:3]}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:  # past max_tokens: the length ends it
            raise InvalidRequestError("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequestError("n", f"must be an integer in [1, {MAX_CHOICES}], got {self.n!r}")
        if self.n > 1 and self.seed is not None and self.seed + self.n > 2**63:
            raise InvalidRequestError("seed", f"choice i is seeded seed + i: at most 2**63 - n, got {self.seed}")
        if not isinstance(self.output_offset, int) or self.output_offset < 0:
            raise InvalidRequestError("output_offset", f"must be an integer >= 0, got {self.output_offset!r}")
        if self.constraint is not None:
            self.constraint.validate()


class ConstraintKind(str, enum.Enum):
    """What a constraint's `spec` is (engine/grammar.py compiles each)."""

    JSON = "json"  # any JSON object (OpenAI's response_format json_object); spec unused
    JSON_SCHEMA = "json_schema"  # a JSON Schema, as JSON text
    REGEX = "regex"  # a regular expression (Rust regex syntax) the whole output matches
    CHOICE = "choice"  # a JSON array of strings: the output is exactly one of them
    GRAMMAR = "grammar"  # a Lark grammar (llguidance's dialect) or GBNF


@dataclass(frozen=True, slots=True)
class Constraint:
    """The output must match this: the sampler masks every token that would leave it, so a
    request that ends with `stop` is valid by construction (one cut by max_tokens may stop
    mid-structure and ends with `length`)."""

    kind: ConstraintKind
    spec: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ConstraintKind(self.kind))

    def validate(self) -> None:
        """The shape only; whether the grammar engine supports it is engine/grammar.py's check."""
        if self.kind is not ConstraintKind.JSON and not self.spec:
            raise InvalidRequestError("constraint", f"a {self.kind.value} constraint needs its text")
        if len(self.spec) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequestError("constraint", f"{len(self.spec)} characters; at most {MAX_CONSTRAINT_CHARS}")


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the client
