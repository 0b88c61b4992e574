"""What the engine reports: per step a `TokenChunk` per request (core.messages), the last one
carrying its `RequestEnd`; `Engine.generate` sums a request's chunks into a `CompletionResult`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from halfmoon.core.messages import RequestEnd, Timings, TokenChunk, TokenLogprobs, Usage
from halfmoon.core.params import FinishReason

from halfmoon.engine.request import Request
from halfmoon.engine.tokenizer import IncrementalDetokenizer


@dataclass(slots=True)
class CompletionResult:
    """A finished request, as `Engine.generate` returns it."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: FinishReason
    ttft_ms: float
    tpot_ms: float
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    queue_ms: float = 0.0  # arrival -> first admitted to the batch
    prefill_ms: float = 0.0  # first admitted -> first token
    stop_text: str | None = None  # the stop string that ended it, if any
    e2e_ms: float = 0.0  # arrival -> finished
    logprobs: list[TokenLogprobs] | None = None  # one per output token, when it asked for them
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt token k+1's at k, when it asked


@dataclass(slots=True)
class TextState:
    """Streaming text of one request, holding back what could still become a stop string.

    ```
    | emitted | held back (< longest stop string) |
    ```
    """

    detok: IncrementalDetokenizer
    stops: tuple[str, ...]
    text: str = ""
    emitted: int = 0
    stopped: bool = False
    holdback: int = field(init=False)

    def __post_init__(self) -> None:
        self.holdback = max((len(s) for s in self.stops), default=1) - 1

    def push(self, token_id: int, stops: bool = True) -> str | None:
        """Add a token; returns the stop string it completed, if any (`stops` False: none is
        looked for, as before a request's min_tokens)."""
        delta = self.detok.push(token_id)
        if not delta:
            return None
        self.text += delta
        if not self.stops or not stops:
            return None
        window_start = max(0, len(self.text) - len(delta) - self.holdback)
        hits = [(self.text.find(s, window_start), s) for s in self.stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        self.text = self.text[:index]
        self.stopped = True
        return stop

    def take(self, final: bool) -> str:
        """Text not yet emitted (all of it when final, else all but the held-back tail)."""
        if final and not self.stopped:
            self.text += self.detok.flush()
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.holdback)
        chunk = self.text[self.emitted : end]
        self.emitted = end
        return chunk


def request_end(req: Request) -> RequestEnd:
    """How a finished request ended, with its timing figures (what its last chunk carries)."""
    assert req.finish_reason is not None and req.finish_time is not None
    first = req.first_token_time if req.first_token_time is not None else req.finish_time
    n_out = req.num_output_tokens
    tpot = (req.finish_time - first) / (n_out - 1) * 1e3 if n_out > 1 else 0.0
    scheduled = req.scheduled_time if req.scheduled_time is not None else first
    timings = Timings(queue_ms=(scheduled - req.arrival_time) * 1e3,
                      prefill_ms=max(0.0, first - scheduled) * 1e3, transfer_ms=0.0,
                      ttft_ms=(first - req.arrival_time) * 1e3, mean_tpot_ms=tpot,
                      e2e_ms=(req.finish_time - req.arrival_time) * 1e3)
    usage = Usage(req.num_prompt_tokens, req.num_cached_tokens, n_out)
    return RequestEnd(req.finish_reason, req.stop_text, usage, timings, req.num_preemptions,
                      speculative_proposed=req.spec_proposed, speculative_accepted=req.spec_accepted)


@dataclass(slots=True)
class Family:
    """The choices of an n > 1 request still running: the request ends with the last of them,
    its usage summing every choice's output tokens."""

    n: int
    left: int = field(init=False)
    completion_tokens: int = 0
    preemptions: int = 0
    proposed: int = 0
    accepted: int = 0

    def __post_init__(self) -> None:
        self.left = self.n

    def ended(self, end: RequestEnd) -> RequestEnd | None:
        """Count one choice's end; the request's own once every choice has ended."""
        self.left -= 1
        self.completion_tokens += end.usage.completion_tokens
        self.preemptions += end.num_preemptions
        self.proposed += end.speculative_proposed
        self.accepted += end.speculative_accepted
        if self.left:
            return None
        return replace(end, usage=replace(end.usage, completion_tokens=self.completion_tokens),
                       num_preemptions=self.preemptions, speculative_proposed=self.proposed,
                       speculative_accepted=self.accepted)


def completion_result(request_id: str, prompt_ids: list[int], chunks: list[TokenChunk],
                      index: int = 0) -> CompletionResult:
    """Choice `index` of a finished request, its chunks summed up (the request's last chunk
    carries its end; the choice's last one how the choice ended)."""
    end = chunks[-1].end
    assert end is not None
    mine = [c for c in chunks if c.index == index]
    choice = next(c.choice_finished for c in reversed(mine) if c.choice_finished is not None)
    t = end.timings
    return CompletionResult(request_id, prompt_ids, [t for c in mine for t in c.token_ids],
                            "".join(c.text for c in mine), choice.finish_reason, t.ttft_ms,
                            t.mean_tpot_ms, end.num_preemptions, end.usage.cached_prompt_tokens,
                            t.queue_ms, t.prefill_ms, choice.stop, t.e2e_ms,
                            None if mine[-1].logprobs is None else [lp for c in mine for lp in c.logprobs or ()],
                            next((list(c.prompt_logprobs) for c in mine if c.prompt_logprobs is not None), None))
