"""Per-request sampling and stop parameters (validated when a request is added), and why a
request finished."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from halfmoon.core.errors import InvalidRequestError


GREEDY_EPS = 1e-5  # temperatures below this sample greedily (as vLLM does)


def check_token_ids(field: str, ids: Sequence[int], vocab_size: int) -> list[int]:
    """`ids` as a list; InvalidRequestError naming `field` when one is outside the vocabulary."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(field, f"ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return list(ids)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1.0 = off; seed None = random."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = field(default=())
    speculative: bool = True  # False: this request opts out of speculative decoding

    def __post_init__(self) -> None:
        # Accept lists from callers but keep the frozen object hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))

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
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must be non-empty")


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the client
