"""Workloads for `halfmoon bench serve`: timed requests of token ids, from a trace or synthetic.

Both sources give the same thing, a `Workload` of `Request(arrival_s, prompt_ids, max_tokens)`
sorted by arrival, plus the length of the window the arrivals span (goodput is divided by it):

- `trace_workload`: a Mooncake trace (`timestamp` ms / speed = arrival; prompts synthesized
  from `hash_ids`, so equal hash ids give equal 512-token blocks; see bench/trace.py).
- `chat_workload`: Poisson arrivals at `rate` req/s for `duration_s`, each prompt a shared
  system prompt followed by a per-request user turn:

      | system prompt (shared, ~64 t) | user turn (lognormal, 64..384 t) |   output 32..128 t

Token ids are in [MIN_TOKEN_ID, vocab) so no prompt carries the model's special tokens (SmolLM2
keeps its specials below 100). Everything is deterministic from the seed; a request's content
depends only on (seed, its index), never on the rate, so a rate sweep replays the same prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from halfmoon.bench.trace import DEFAULT_VOCAB_SIZE, HASH_BLOCK_TOKENS, read_trace, synthesize_tokens

MIN_TOKEN_ID = 100  # below this SmolLM2 keeps its special tokens; prompts never use them

# The synthetic chat workload's shape (tokens), sized for SmolLM2-135M on a CPU core.
SYSTEM_PROMPT_TOKENS = 64
USER_TOKENS_MEDIAN = 160
USER_TOKENS_SIGMA = 0.5  # of the lognormal's log; clipped to the range below
USER_TOKENS_RANGE = (64, 384)
OUTPUT_TOKENS_RANGE = (32, 128)


@dataclass(frozen=True, slots=True)
class Request:
    """One request to replay: sent `arrival_s` seconds after the replay starts; `ignore_eos`:
    its output runs to exactly `max_tokens` (synthetic token prompts have no natural end)."""

    arrival_s: float
    prompt_ids: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool = True


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests sorted by arrival; `duration_s` is the window their arrivals span."""

    name: str
    requests: tuple[Request, ...]
    duration_s: float

    def summary(self) -> dict[str, object]:
        prompts = [len(r.prompt_ids) for r in self.requests]
        outputs = [r.max_tokens for r in self.requests]
        return {"name": self.name, "requests": len(self.requests), "duration_s": round(self.duration_s, 3),
                "prompt_tokens": sum(prompts), "output_tokens": sum(outputs),
                "mean_prompt_tokens": round(float(np.mean(prompts)), 1) if prompts else None,
                "mean_output_tokens": round(float(np.mean(outputs)), 1) if outputs else None}


@dataclass(frozen=True, slots=True)
class Caps:
    """What fits the served model: prompts truncated (their tail dropped, so shared prefixes
    stay shared) and outputs capped; None = no cap."""

    max_input_tokens: int | None = None
    max_output_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_input_tokens", "max_output_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    def apply(self, arrival_s: float, prompt: np.ndarray, max_tokens: int) -> Request:
        if self.max_input_tokens is not None:
            prompt = prompt[: self.max_input_tokens]
        if self.max_output_tokens is not None:
            max_tokens = min(max_tokens, self.max_output_tokens)
        # A trace may ask for 0 output tokens; the API needs at least one (the first token).
        return Request(arrival_s, tuple(int(t) for t in prompt), max(1, max_tokens))


def trace_workload(path: str | Path, speed: float = 1.0, caps: Caps | None = None,
                   max_requests: int | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE,
                   scale_tokens: int = HASH_BLOCK_TOKENS) -> Workload:
    """The requests of a Mooncake trace, arriving at timestamp / speed (the trace's own clock,
    so a trace starting at t=150 ms sends its first request 150 ms / speed in); `scale_tokens`
    tokens per trace block (bench.trace.synthesize_tokens: 512 = the trace as written)."""
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    caps = caps or Caps()
    requests = []
    for number, entry in enumerate(read_trace(path)):
        if max_requests is not None and number >= max_requests:
            break
        prompt = synthesize_tokens(entry, vocab_size - MIN_TOKEN_ID, scale_tokens) + MIN_TOKEN_ID
        requests.append(caps.apply(entry.timestamp / 1e3 / speed, prompt, entry.output_length))
    requests.sort(key=lambda r: r.arrival_s)  # stable: equal timestamps keep file order
    duration = requests[-1].arrival_s if requests else 0.0
    scaled = "" if scale_tokens == HASH_BLOCK_TOKENS else f", {scale_tokens} tokens per trace block"
    return Workload(f"trace {Path(path).name} x{speed:g}{scaled}", tuple(requests), duration)


def chat_workload(rate: float, duration_s: float, seed: int = 0, caps: Caps | None = None,
                  vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """Poisson arrivals at `rate` req/s in [0, duration_s), chat-shaped prompts (module doc)."""
    if not rate > 0 or not duration_s > 0:
        raise ValueError(f"rate and duration must be > 0, got {rate}, {duration_s}")
    caps = caps or Caps()
    arrivals = poisson_arrivals(rate, duration_s, seed)
    system = _token_ids(np.random.default_rng([seed, 0x5157]), SYSTEM_PROMPT_TOKENS, vocab_size)
    requests = []
    for index, arrival in enumerate(arrivals):
        prompt, max_tokens = chat_turn(seed, index, system, vocab_size)
        requests.append(caps.apply(arrival, prompt, max_tokens))
    return Workload(f"synthetic chat {rate:g} req/s", tuple(requests), duration_s)


def poisson_arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process: exponential gaps of mean 1/rate, inside the window."""
    rng = np.random.default_rng([seed, 0xA77])
    arrivals, now = [], 0.0
    while True:
        now += float(rng.exponential(1.0 / rate))
        if now >= duration_s:
            return arrivals
        arrivals.append(now)


def chat_turn(seed: int, index: int, system: np.ndarray, vocab_size: int) -> tuple[np.ndarray, int]:
    """Request `index`'s prompt (system prompt + its user turn) and output length."""
    rng = np.random.default_rng([seed, index])
    lo, hi = USER_TOKENS_RANGE
    user_len = int(np.clip(round(rng.lognormal(math.log(USER_TOKENS_MEDIAN), USER_TOKENS_SIGMA)), lo, hi))
    user = _token_ids(rng, user_len, vocab_size)
    max_tokens = int(rng.integers(OUTPUT_TOKENS_RANGE[0], OUTPUT_TOKENS_RANGE[1] + 1))
    return np.concatenate([system, user]), max_tokens


def _token_ids(rng: np.random.Generator, n: int, vocab_size: int) -> np.ndarray:
    return rng.integers(MIN_TOKEN_ID, vocab_size, size=n, dtype=np.int64)
