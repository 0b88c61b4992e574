"""Request migration: what a request's client has received, so the request can move to other (or
restarted) workers and go on where it stopped.

When a worker dies under a request, or its KV transfer fails, the Conductor re-admits it with its
prompt + the tokens the client already has as the new prompt and `max_tokens` less those (the
prefix cache makes the re-prefill cheap). The next token the new prefill samples is the one the
client would have got next, so greedy output is token-identical to an undisturbed run. Seeded
sampling goes on deterministically from `seed + tokens sent` (the same fault point gives the same
text; it is not the undisturbed run's text). A stop string that would span the move is not seen
(the new workers do not know the text before it).

    progress = Progress(inp, arrival)
    inp2 = progress.next_input()          # the original, or the continuation after a move
    chunk = progress.forward(chunk)       # what the client gets: ids / usage of the whole request
    progress.complete_end(...)            # every token sent but the end lost: the end made here
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from halfmoon.conductor.backend import GenerationInput
from halfmoon.core.messages import RequestEnd, Timings, TokenChunk, Usage
from halfmoon.core.params import FinishReason


@dataclass(slots=True)
class Progress:
    """One request across its moves: the tokens its client received and when the first came."""

    inp: GenerationInput
    arrival: float  # time.perf_counter() when the request arrived
    sent: list[int] = field(default_factory=list)
    first_token_at: float | None = None  # time.perf_counter() of the client's first token
    moves: int = 0  # times it moved to other workers
    base: int = 0  # tokens sent before the current run started

    @property
    def left(self) -> int:
        """Tokens the request may still make."""
        return self.inp.params.max_tokens - len(self.sent)

    def next_input(self) -> GenerationInput:
        """The request as it runs next: unchanged before its first token, else its continuation."""
        self.base = len(self.sent)
        if not self.sent:
            return self.inp
        p, n = self.inp.params, len(self.sent)
        # the tokens sent ride in the prompt: as outputs still for the penalties and min_tokens
        # ... and its prompt logprobs went with its first chunk: not asked (nor recomputed) again
        params = replace(p, max_tokens=self.left, seed=None if p.seed is None else p.seed + n,
                         output_offset=p.output_offset + n, prompt_logprobs=None)
        return replace(self.inp, prompt_ids=[*self.inp.prompt_ids, *self.sent], params=params)

    def forward(self, chunk: TokenChunk) -> TokenChunk:
        """Count `chunk` as sent; after a move, its end (if any) made whole: the original prompt,
        every token generated across moves, the client's own TTFT and TPOT."""
        now = time.perf_counter()
        if chunk.token_ids and self.first_token_at is None:
            self.first_token_at = now
        self.sent.extend(chunk.token_ids)
        if chunk.end is None or not self.base:
            return chunk
        end, first = chunk.end, self.first_token_at or now
        n = self.base + end.usage.completion_tokens
        usage = replace(end.usage, prompt_tokens=len(self.inp.prompt_ids), completion_tokens=n)
        timings = replace(end.timings, ttft_ms=(first - self.arrival) * 1e3,
                          mean_tpot_ms=(now - first) * 1e3 / (n - 1) if n > 1 else 0.0)
        return replace(chunk, end=replace(end, usage=usage, timings=timings))

    def complete_end(self, request_id: str) -> TokenChunk:
        """The last chunk of a request whose every token reached the client before its workers
        failed (nothing is left to generate): finish `length`, as the undisturbed run ends."""
        now = time.perf_counter()
        first = self.first_token_at or now
        n = len(self.sent)
        tpot = (now - first) * 1e3 / (n - 1) if n > 1 else 0.0
        timings = Timings(0.0, 0.0, 0.0, (first - self.arrival) * 1e3, tpot, (now - self.arrival) * 1e3)
        end = RequestEnd(FinishReason.LENGTH, None, Usage(len(self.inp.prompt_ids), 0, n), timings)
        return TokenChunk(request_id, [], "", end)
