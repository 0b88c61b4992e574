"""What a step does to the logits beyond sampling (SamplingParams.processes_logits / .logprobs):
biases, min_tokens, repetition / frequency / presence penalties, and the logprobs reported.

The runner calls `process` and `record_logprobs` only when some request of the step asks for
them (`SamplingParams.plain` is the fast path: nothing here runs, nothing is allocated).

Rows: one per sampled request, or a verification's `1 + len(draft)` rows (engine/runner.py).
Row j of a verification samples the output after `draft[:j]`, so it sees those drafts as
outputs already: its counts and min_tokens position include them. Acceptance stops at the first
draft that differs from what row j samples, so every emitted token was sampled from exactly the
distribution plain decoding would have used: penalties under speculation give the same tokens.

A request's counts live on the request (`Request.penalties`: the output tokens' counts and the
prompt + output tokens seen, on the logits' device) and catch up with its tokens each step, so a
step costs one scatter per request, not a pass over its history. A migrated request resumes with
its outputs inside its prompt: `output_offset` of them count as outputs.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from halfmoon.core.messages import TokenLogprobs
from halfmoon.engine.grammar import apply_bitmask
from halfmoon.engine.request import Request


@dataclass(slots=True)
class PenaltyState:
    """A request's token counts for the penalties: `counts` of its outputs, `seen` over prompt
    + outputs, both [vocab] on the logits' device, up to `counted` tokens of `token_ids`."""

    counts: torch.Tensor
    seen: torch.Tensor
    counted: int = 0

    def catch_up(self, req: Request) -> None:
        new = req.token_ids[self.counted :]
        if not new:
            return
        ids = torch.tensor(new, dtype=torch.int64, device=self.counts.device)
        self.seen[ids] = True
        first_output = req.num_prompt_tokens - req.params.output_offset
        outputs = ids[max(0, first_output - self.counted) :]
        if outputs.numel():
            self.counts.index_add_(0, outputs, torch.ones_like(outputs, dtype=self.counts.dtype))
        self.counted = req.num_tokens


def _state(req: Request, vocab: int, device: torch.device) -> PenaltyState:
    if req.penalties is None:
        req.penalties = PenaltyState(torch.zeros(vocab, dtype=torch.float32, device=device),
                                     torch.zeros(vocab, dtype=torch.bool, device=device))
    state: PenaltyState = req.penalties
    state.catch_up(req)
    return state


def row_spans(drafts: Sequence[Sequence[int]] | None, n: int) -> list[tuple[int, int]]:
    """(first row, rows) of each sampled request: one each, or a verification's 1 + drafts."""
    if drafts is None:
        return [(i, 1) for i in range(n)]
    spans, at = [], 0
    for d in drafts:
        spans.append((at, 1 + len(d)))
        at += 1 + len(d)
    return spans


def process(logits: torch.Tensor, requests: Sequence[Request], drafts: Sequence[Sequence[int]] | None,
            stop_ids: Collection[int], bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """`logits` with every request's biases, min_tokens and penalties applied, then its
    constraint's `bitmask` (engine/grammar.py step_bitmask): a copy when any request has some;
    `logits` itself, untouched, when none has."""
    asking = [i for i, r in enumerate(requests) if r.params.processes_logits]
    if not asking:
        return logits
    out = logits.clone()
    spans = row_spans(drafts, len(requests))
    for i in asking:
        start, rows = spans[i]
        draft = drafts[i] if drafts is not None else ()
        _apply(out[start : start + rows], requests[i], draft, stop_ids)
    if bitmask is not None:
        constrained = [i for i in asking if requests[i].grammar is not None]
        _constrain(out, logits, bitmask, _rows(spans, constrained),
                   _rows(spans, [i for i in constrained if _blocks_tokens(requests[i])]))
    return out


def _rows(spans: Sequence[tuple[int, int]], requests: Sequence[int]) -> list[int]:
    return [r for i in requests for r in range(spans[i][0], spans[i][0] + spans[i][1])]


def _blocks_tokens(req: Request) -> bool:
    """Whether the request's other processing can make a token impossible (-inf): min_tokens
    still holding EOS back, or a bias (penalties only shift logits)."""
    p = req.params
    return bool(p.logit_bias) or p.min_tokens > req.num_output_tokens + p.output_offset


def _constrain(out: torch.Tensor, raw: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
               suspects: list[int]) -> None:
    """The grammar's mask on `rows`. A row of `suspects` that the other processing left nothing
    the grammar allows (min_tokens holding back the EOS a complete grammar needs, a -100 bias)
    gets the grammar's mask over its raw logits: the constraint wins."""
    if not rows:
        return
    apply_bitmask(out, bitmask, rows)
    if not suspects:
        return
    dead = [r for r, empty in zip(suspects, torch.isneginf(out[suspects]).all(dim=-1).tolist()) if empty]
    if dead:
        out[dead] = raw[dead]
        apply_bitmask(out, bitmask, dead)


def _apply(rows: torch.Tensor, req: Request, draft: Sequence[int], stop_ids: Collection[int]) -> None:
    """In place on one request's rows (row j after `draft[:j]`)."""
    p = req.params
    if p.logit_bias:
        ids = torch.tensor([k for k, _ in p.logit_bias], device=rows.device)
        rows[:, ids] += torch.tensor([v for _, v in p.logit_bias], dtype=rows.dtype, device=rows.device)
    _min_tokens(rows, req, stop_ids)
    if p.repetition_penalty == 1.0 and not p.frequency_penalty and not p.presence_penalty:
        return
    state = _state(req, rows.shape[1], rows.device)
    counts, seen = state.counts.expand(rows.shape[0], -1), state.seen.expand(rows.shape[0], -1)
    if draft:  # row j: the drafts before it are outputs already
        extra = torch.zeros(rows.shape[0], rows.shape[1], dtype=counts.dtype, device=rows.device)
        extra[torch.arange(1, rows.shape[0], device=rows.device), torch.tensor(list(draft), device=rows.device)] = 1.0
        extra = extra.cumsum(dim=0)
        counts, seen = counts + extra, seen | (extra > 0)
    if p.repetition_penalty != 1.0:
        r = p.repetition_penalty
        rows.copy_(torch.where(seen, torch.where(rows > 0, rows / r, rows * r), rows))
    if p.frequency_penalty or p.presence_penalty:
        rows -= counts * p.frequency_penalty + (counts > 0).to(rows.dtype) * p.presence_penalty


def _min_tokens(rows: torch.Tensor, req: Request, stop_ids: Collection[int]) -> None:
    """Rows that sample an output before the `min_tokens`-th cannot end it (EOS, stop ids)."""
    p = req.params
    produced = req.num_output_tokens + p.output_offset  # outputs before row 0's token
    blocked = min(rows.shape[0], p.min_tokens - produced)
    if blocked <= 0:
        return
    enders = sorted({*stop_ids, *p.stop_token_ids} if not p.ignore_eos else set(p.stop_token_ids))
    if enders:
        rows[:blocked, enders] = float("-inf")


def record_logprobs(raw: torch.Tensor, requests: Sequence[Request], drafts: Sequence[Sequence[int]] | None,
                    emitted: Sequence[Sequence[int]]) -> None:
    """Append each asking request's emitted tokens' logprobs (log_softmax of `raw`, the model's
    own logits) to `Request.pending_logprobs`: token j of a request from its row j."""
    asking = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not asking:
        return
    spans = row_spans(drafts, len(requests))
    rows = [spans[i][0] + j for i in asking for j in range(len(emitted[i]))]
    tokens = [t for i in asking for t in emitted[i]]
    if not rows:
        return
    picked = raw[rows[0] : rows[-1] + 1] if rows == list(range(rows[0], rows[-1] + 1)) else raw[rows]  # no copy
    logp = torch.log_softmax(picked.float(), dim=-1)  # (CPU: faster than logsumexp)
    k = max(requests[i].params.logprobs or 0 for i in asking)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device).unsqueeze(1)).squeeze(1).tolist()
    top_lp, top_ids = (logp.topk(k, dim=-1, sorted=True) if k else (logp[:, :0], logp[:, :0].long()))
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    at = 0
    for i in asking:
        req, want = requests[i], requests[i].params.logprobs or 0
        pending = req.pending_logprobs if req.pending_logprobs is not None else []
        for _ in emitted[i]:
            pending.append(TokenLogprobs(chosen[at], tuple(zip(top_ids[at][:want], top_lp[at][:want]))))
            at += 1
        req.pending_logprobs = pending


def record_prompt_logprobs(logits: torch.Tensor, chunks: Sequence[tuple[Request, int, int]]) -> None:
    """Prompt logprobs of each chunk (request, first position, rows), its rows in `logits` in
    order: row i predicts prompt token first + i + 1. A recomputed chunk (preemption) adds
    nothing it already has."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    at = 0
    for req, first, n in chunks:
        rows, k = logp[at : at + n], req.params.prompt_logprobs or 0
        at += n
        targets = torch.tensor(req.token_ids[first + 1 : first + 1 + n], device=rows.device)
        chosen = rows.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        top_lp, top_ids = rows.topk(k, dim=-1) if k else (rows[:, :0], rows[:, :0].long())
        have = req.prompt_logprobs if req.prompt_logprobs is not None else []
        for i, (lp, ids, lps) in enumerate(zip(chosen, top_ids.tolist(), top_lp.tolist())):
            if first + i == len(have):  # entry k is token k + 1's
                have.append(TokenLogprobs(lp, tuple(zip(ids, lps))))
        req.prompt_logprobs = have


def take_prompt_logprobs(req: Request) -> tuple[TokenLogprobs, ...] | None:
    """A request's prompt logprobs, once and only whole (its first chunk carries them)."""
    have = req.prompt_logprobs or []
    if req.params.prompt_logprobs is None or req.prompt_logprobs_sent or len(have) < req.num_prompt_tokens - 1:
        return None  # not asked, sent already, or not complete (an abort mid-prefill): none
    req.prompt_logprobs_sent = True
    return tuple(have)


def take_logprobs(req: Request, n: int, final: bool) -> tuple[TokenLogprobs, ...] | None:
    """The logprobs of the `n` tokens a chunk carries (None when the request did not ask);
    the rest (tokens a stop cut off) is dropped with the request's last chunk."""
    if req.params.logprobs is None:
        return None
    pending = req.pending_logprobs or []
    out, req.pending_logprobs = tuple(pending[:n]), ([] if final else pending[n:])
    return out
