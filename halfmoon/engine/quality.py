"""How close a quantized engine stays to the fp32 one: perplexity on a fixed text and greedy
agreement on a fixed prompt set (issue 23's bounds: int8 within 1% perplexity, int4 within 3%).

The bounds live here (`PERPLEXITY_BOUND`, `MIN_TOP1_AGREEMENT`): the quantization tests
(tests/engine/test_quantization.py) and the test of serve's default precision
(tests/engine/test_serve_precision.py) hold engines to the same ones.

Both are measured through the engine's own model and runner, so they see exactly the layers a
request would: `perplexity` is one prefill of the text with logits at every position,
`greedy_outputs` the engine's `generate`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from halfmoon.core.params import SamplingParams
from halfmoon.engine.request import Request
from halfmoon.engine.scheduler import ScheduledRequest

if TYPE_CHECKING:
    from halfmoon.engine.engine import Engine

# Plain English prose, not in any test oracle: the perplexity text (~250 tokens).
QUALITY_TEXT = (
    "The river town woke slowly in the winter. Before dawn the bakers lit their ovens, and the "
    "smell of bread drifted along the narrow streets toward the harbor, where fishermen were "
    "mending nets by lamplight. By the time the sun rose over the hills, the market square was "
    "full of carts: farmers sold apples, cheese and firewood, and children ran between the stalls "
    "with their hands full of roasted chestnuts. The schoolteacher, a patient woman who had taught "
    "three generations of the same families, rang the bell at eight o'clock. Her students learned "
    "to read from old books that had been repaired many times, and to count with wooden beads on a "
    "frame. In the afternoon the wind turned, clouds gathered over the water, and the boats came "
    "home early. That evening the whole town gathered in the hall to hear the mayor explain how the "
    "new bridge would be built, who would pay for it, and how long the work would take."
)
QUALITY_PROMPTS = (
    "The old lighthouse keeper looked out at the sea and",
    "Q: What is the boiling point of water at sea level?\nA:",
    "def add(a, b):\n    return",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "Paris is the capital of",
    "To make a cup of tea, first",
    "The largest planet in our solar system is",
)
GREEDY_TOKENS = 32
# |perplexity / fp32's - 1| by weight quantization (issue 23); `none` is bf16 compute without
# quantization (measured -0.2% .. +0.6% against fp32): held to int8's 1%.
PERPLEXITY_BOUND = {"none": 0.01, "int8": 0.01, "int4": 0.03}
# The share of the text's positions whose next-token argmax (teacher-forced) equals fp32's.
MIN_TOP1_AGREEMENT = 0.9


class Agreement(NamedTuple):
    """Greedy outputs of an engine against a reference engine's, prompt by prompt."""

    identical: int  # prompts whose outputs are token-identical
    prompts: int
    matching_tokens: int  # sum of the matching prefixes
    tokens: int

    @property
    def token_fraction(self) -> float:
        return self.matching_tokens / self.tokens if self.tokens else 1.0


def prefill_logits(engine: Engine, ids: Sequence[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] at every position (teacher forcing): one prefill of `ids` through
    the engine's runner — and its tensor-parallel ranks, which run the same step — in blocks
    borrowed from its pool (never cached) and given back. A scratch cache of rank 0's alone
    would hang a tp > 1 engine: its ranks would never join the step's collectives."""
    n = len(ids)
    blocks = engine.reserve_blocks(n)
    try:
        req = Request("quality", list(ids), SamplingParams(), n, torch.Generator())
        req.block_table = blocks
        step = engine.runner.prepare([ScheduledRequest(req, n, True)])
        step.logits_rows = torch.arange(n)
        if engine.runner.step_sync is not None:
            engine.runner.step_sync(step)
        return engine.model.forward(step.input_ids, step.positions, engine.kv_cache, step.meta, step.logits_rows,
                                    None, step.rope_lens)
    finally:
        engine.release_blocks(blocks)


def perplexity(engine: Engine, ids: Sequence[int]) -> float:
    """exp(mean next-token cross-entropy) of `ids` under the engine's model."""
    if len(ids) < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    logits = prefill_logits(engine, ids)[:-1]
    return math.exp(F.cross_entropy(logits, torch.tensor(ids[1:])).item())


def greedy_outputs(engine: Engine, prompts: Sequence[Sequence[int]],
                   max_tokens: int = GREEDY_TOKENS) -> list[list[int]]:
    """Each prompt's greedy continuation (EOS ignored, so every output has `max_tokens`)."""
    results = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [r.output_ids for r in results]


def agreement(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> Agreement:
    if len(outputs) != len(reference):
        raise ValueError(f"{len(outputs)} outputs against {len(reference)} reference outputs")
    matching = [_matching_prefix(a, b) for a, b in zip(outputs, reference)]
    return Agreement(sum(list(a) == list(b) for a, b in zip(outputs, reference)), len(outputs),
                     sum(matching), sum(len(b) for b in reference))


def _matching_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def encode_prompts(engine: Engine) -> list[list[int]]:
    """`QUALITY_PROMPTS` as token ids (BOS as the tokenizer adds it)."""
    return [engine.tokenizer.encode(p) for p in QUALITY_PROMPTS]
