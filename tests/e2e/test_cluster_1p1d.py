"""The disaggregated cluster at its smallest, 1 prefill + 1 decode worker: token-identical to one
process for 16 concurrent requests of mixed lengths, over ucxx (what `auto`, the default, picks
where it imports). The 2P2D cluster of test_cluster.py runs the same check over tcp, and
tests/transport the tcp fallback between processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from halfmoon.client import Client
from halfmoon.core.params import SamplingParams
from halfmoon.engine.engine import Engine
from halfmoon.kvpool.redis_server import EmbeddedRedis
from tests.e2e.support import generate_all, prompts, reference, start_cluster, worker_load

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_1p1d_is_token_identical_to_one_process(tmp_path: Path, redis: EmbeddedRedis, engine: Engine) -> None:
    small = start_cluster(tmp_path, 1, 1, redis, "ucxx")
    try:
        ids = prompts(engine)
        max_tokens = [3 + (i * 7) % 11 for i in range(16)]
        assert generate_all(small.grpc_target, ids, max_tokens) == reference(engine, ids, max_tokens)
        assert worker_load(small, "decode-0").kv_address.startswith("ucxx://")
        _n_choices_cross_once(small, engine)
    finally:
        small.stop()


def _n_choices_cross_once(cluster, engine: Engine) -> None:
    """n = 3 through the Conductor (issue 46): one prefill, the KV bytes of one request, and
    each choice (seeded seed + i, with logprobs) as one process gives it."""
    ids = engine.tokenizer.encode("Once upon a time, in a land far away, there lived a")
    kw = {"max_tokens": 6, "temperature": 0.8, "seed": 21, "ignore_eos": True, "logprobs": 2}
    want = engine.generate_choices(ids, SamplingParams(n=3, **kw))
    with Client(cluster.grpc_target) as sdk:
        before = worker_load(cluster, "decode-0").kv_bytes_received
        sdk.generate(prompt_token_ids=ids, max_tokens=2, cache_salt="one")
        one = worker_load(cluster, "decode-0").kv_bytes_received - before
        result = sdk.generate(prompt_token_ids=ids, n=3, cache_salt="three", **kw)
        three = worker_load(cluster, "decode-0").kv_bytes_received - before - one
    assert three == one > 0, "n = 3 moved other than one prompt's KV"
    assert [c.token_ids for c in result.choices] == [w.output_ids for w in want]
    for choice, w in zip(result.choices, want):
        assert choice.logprobs is not None and w.logprobs is not None
        assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(choice.logprobs, w.logprobs))
    assert result.usage.completion_tokens == 18
