"""Staggered arrivals for the speculation tests: each request arrives after the earlier ones have
stepped a while, so a request prefills in the very steps where others verify drafts."""

from __future__ import annotations

from halfmoon.engine.engine import Engine
from halfmoon.engine.scheduler import SchedulerOutput
from halfmoon.core.params import SamplingParams


def staggered(engine: Engine, prompts: list[list[int]], params: SamplingParams,
              steps_between: int = 2) -> tuple[list[list[int]], int]:
    """(each request's output tokens in prompt order, how many steps verified drafts and computed
    a prefill chunk together). Request i is added after `steps_between` steps of 0 .. i-1."""
    mixed = 0
    schedule = engine.scheduler.schedule

    def counting() -> SchedulerOutput:
        nonlocal mixed
        out = schedule()
        mixed += (any(s.draft for s in out.scheduled)
                  and any(s.num_tokens > 1 and not s.draft for s in out.scheduled))
        return out

    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}

    def step() -> None:
        for chunk in engine.step():
            got[chunk.request_id] += chunk.token_ids

    engine.scheduler.schedule = counting  # type: ignore[method-assign]
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, request_id=f"r{i}")
            for _ in range(steps_between):
                step()
        while engine.has_unfinished():
            step()
    finally:
        del engine.scheduler.schedule  # the class's method again
    return [got[f"r{i}"] for i in range(len(prompts))], mixed
