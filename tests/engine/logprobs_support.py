"""Oracles for logprobs and logit processing (issue 46), shared by SmolLM2's tests
(test_logprobs.py) and the tiny families' (test_logprobs_families.py).

* `hf_logprobs`: transformers' own forward in fp32, log_softmax in fp64; row i predicts token i + 1.
* `assert_logprobs` / `assert_prompt_logprobs`: what the engine reported equals those rows within
  TOL, and its top-k ids are the oracle's except where candidates tie within TOL.
* `processed`: the documented processing of one step's logits (OpenAI's formula for biases and
  frequency / presence penalties, the repetition penalty over prompt + outputs, min_tokens),
  written out plainly in fp64.
* `assert_follows_reference`: the engine's greedy tokens against `processed` on transformers'
  logits, teacher-forced: at every step the engine's token is the reference's argmax given the
  tokens before it (or within TOL of it: a tie, where either is right), no stop comes early and
  the output ends where a stop or max_tokens says. With no ties this is exactly "the engine's
  greedy output equals the reference's greedy output" (by induction on the step), and it costs
  one forward per sequence instead of one per token.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch

from halfmoon.core.messages import TokenLogprobs
from halfmoon.core.params import SamplingParams

TOL = 2e-3


@torch.inference_mode()
def hf_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits over `ids` (fp64): row i predicts token i + 1."""
    return torch.log_softmax(hf_logits(model, ids), dim=-1)


@torch.inference_mode()
def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].double()


def assert_token_logprobs(row: torch.Tensor, token: int, got: TokenLogprobs, k: int, where: str) -> None:
    """One position: the chosen token's logprob and the top `k` (ids, then each value)."""
    assert abs(got.logprob - float(row[token])) < TOL, (where, got.logprob, float(row[token]))
    assert len(got.top) == k, (where, got.top)
    want = row.topk(k) if k else None
    assert want is None or [i for i, _ in got.top] == want.indices.tolist() or _tied(want.values, got), \
        (where, got.top, want)
    assert all(abs(lp - float(row[i])) < TOL for i, lp in got.top), (where, got.top)


def _tied(best: torch.Tensor, got: TokenLogprobs) -> bool:
    """The top-k differs from the oracle's only where candidates are within rounding: rank by
    rank, the values reported are the oracle's k best."""
    return all(abs(lp - float(w)) < TOL for (_, lp), w in zip(got.top, best))


def assert_logprobs(rows: torch.Tensor, prompt: Sequence[int], output_ids: Sequence[int],
                    logprobs: Sequence[TokenLogprobs] | None, k: int, greedy: bool = True) -> None:
    """Every output token's logprobs against `rows` (`hf_logprobs` of prompt + outputs). Greedy
    with no processing: each token is the oracle's argmax (within TOL) and the top-1 reported."""
    assert logprobs is not None and len(logprobs) == len(output_ids), (len(output_ids), logprobs)
    for j, (token, got) in enumerate(zip(output_ids, logprobs)):
        row = rows[len(prompt) - 1 + j]
        assert_token_logprobs(row, token, got, k, f"output {j}")
        if greedy:
            assert float(row[token]) >= float(row.max()) - TOL, (j, token, int(row.argmax()))
            assert not k or got.top[0][0] == token, (j, token, got.top)


def assert_prompt_logprobs(rows: torch.Tensor, prompt: Sequence[int],
                           got: Sequence[TokenLogprobs] | None, k: int) -> None:
    """Entry i is prompt token i + 1's (the first token has none), against `rows`' row i."""
    assert got is not None and len(got) == len(prompt) - 1, (len(prompt), got)
    for i, entry in enumerate(got):
        assert_token_logprobs(rows[i], prompt[i + 1], entry, k, f"prompt token {i + 1}")


def enders(params: SamplingParams, stop_ids: Collection[int]) -> set[int]:
    """Tokens that end the output: the request's stop ids, and EOS unless it ignores EOS."""
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(stop_ids))


def processed(logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int], outputs: Sequence[int],
              stop_ids: Collection[int]) -> torch.Tensor:
    """One step's fp64 `logits` after `outputs`, processed as documented, token by token (a
    migrated request's last `output_offset` prompt tokens count as outputs)."""
    x = torch.tensor(logits.tolist(), dtype=torch.float64)  # a plain tensor, to edit
    produced = [*prompt[len(prompt) - params.output_offset:], *outputs] if params.output_offset else list(outputs)
    for token, bias in params.logit_bias:
        x[token] += bias
    if len(produced) < params.min_tokens:
        for token in enders(params, stop_ids):
            x[token] = float("-inf")
    if params.repetition_penalty != 1.0:
        r = params.repetition_penalty
        for token in set(prompt) | set(outputs):
            x[token] = x[token] / r if x[token] > 0 else x[token] * r
    for token in set(produced):
        x[token] -= produced.count(token) * params.frequency_penalty + params.presence_penalty
    return x


def assert_follows_reference(model: Any, prompt: list[int], params: SamplingParams, stop_ids: Collection[int],
                             got: list[int]) -> None:
    """The engine's greedy `got` is the reference's (see the module docstring), up to ties."""
    assert params.max_tokens is not None and got, got
    logits = hf_logits(model, prompt + got)
    for j, token in enumerate(got):
        x = processed(logits[len(prompt) - 1 + j], params, prompt, got[:j], stop_ids)
        best = int(x.argmax())
        assert token == best or float(x[token]) >= float(x[best]) - TOL, \
            f"step {j}: the engine chose {token} ({float(x[token]):.4f}), the reference {best} ({float(x[best]):.4f})"
    ends = enders(params, stop_ids)
    assert not ends.intersection(got[:-1]), (got, ends)
    assert len(got) == params.max_tokens or got[-1] in ends, (len(got), got)


def penalty_cases(new: int) -> dict[str, SamplingParams]:
    """The penalty and bias cases both oracles run (`new` tokens each, EOS ignored)."""
    base = {"max_tokens": new, "ignore_eos": True}
    return {
        "frequency": SamplingParams(**base, frequency_penalty=1.5),
        "presence": SamplingParams(**base, presence_penalty=2.0),
        "repetition": SamplingParams(**base, repetition_penalty=1.3),
        "all-and-bias": SamplingParams(**base, frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.1,
                                       logit_bias={15: 5.0, 28: -100.0, 314: 3.0}),
        "migrated": SamplingParams(**base, frequency_penalty=1.0, output_offset=4),
    }
