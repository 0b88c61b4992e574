"""The chaos suite's fixtures: one embedded Redis per module (the cluster's block index, which a
test may kill -9 and start again), and the six prompts every fault test streams with their
undisturbed greedy tokens (computed once)."""

from __future__ import annotations

import pytest

from halfmoon.engine.engine import Engine
from tests.e2e.conftest import redis  # noqa: F401 - the fixture, shared with the end-to-end tests
from tests.e2e.support import reference

STREAMS, MAX_TOKENS = 6, 128
TOPICS = ["the sea", "a lighthouse", "the moon", "a red fox", "winter rain", "an old clock"]


def prompts(engine: Engine, words: int) -> list[list[int]]:
    """Six different prompts of about `words` words each (no shared prefix between them)."""
    return [engine.tokenizer.encode(f"Write about {topic}. " + "Describe it carefully and slowly. " * (words // 5))
            for topic in TOPICS]


@pytest.fixture(scope="session")
def short(shared_engine: Engine) -> tuple[list[list[int]], list[list[int]]]:
    """Six short prompts and their undisturbed 128 greedy tokens each."""
    ids = prompts(shared_engine, 10)
    return ids, reference(shared_engine, ids, [MAX_TOKENS] * STREAMS)
