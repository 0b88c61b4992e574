"""Device prefix caching in the engine: a repeated prefix is computed once, tokens unchanged."""

from __future__ import annotations

from halfmoon.core.messages import TokenChunk
from halfmoon.engine.engine import Engine
from halfmoon.engine.outputs import completion_result
from halfmoon.core.params import SamplingParams

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def _prompt(engine: Engine, n_blocks: int, seed: int) -> list[int]:
    base = engine.tokenizer.encode("You are a helpful assistant. Answer briefly and precisely. " * 20)
    return [1000 + seed] + base[: n_blocks * 16 + 4]


def _run(engine: Engine, ids: list[int], salt: str | None) -> tuple[list[int], int, int]:
    before = engine.scheduler.stats.prompt_tokens_computed
    rid = engine.add_request(ids, PARAMS, cache_salt=salt)
    chunks: list[TokenChunk] = []
    while not chunks or not chunks[-1].finished:
        chunks += engine.step()
    result = completion_result(rid, ids, chunks)
    computed = engine.scheduler.stats.prompt_tokens_computed - before
    return result.output_ids, computed, result.num_cached_tokens


def test_prompt_served_twice_computes_its_prefix_once(engine: Engine) -> None:
    ids = _prompt(engine, n_blocks=5, seed=1)  # 85 tokens: 5 full blocks + 5
    cold, computed_cold, cached_cold = _run(engine, ids, salt="t-repeat")
    warm, computed_warm, cached_warm = _run(engine, ids, salt="t-repeat")
    assert (computed_cold, cached_cold) == (len(ids), 0)
    assert cached_warm == 5 * 16 and computed_warm == len(ids) - 5 * 16
    assert warm == cold
    engine.pool.check_integrity()


def test_fully_cached_prompt_still_recomputes_its_last_token(engine: Engine) -> None:
    ids = _prompt(engine, n_blocks=4, seed=2)[: 4 * 16]  # exactly 4 full blocks
    cold, _, _ = _run(engine, ids, salt="t-exact")
    warm, computed, cached = _run(engine, ids, salt="t-exact")
    assert cached == 3 * 16 and computed == 16  # the block with the last token runs again
    assert warm == cold


def test_different_cache_salts_never_share_blocks(engine: Engine) -> None:
    ids = _prompt(engine, n_blocks=3, seed=3)
    a, _, _ = _run(engine, ids, salt="tenant-a")
    b, computed, cached = _run(engine, ids, salt="tenant-b")
    assert cached == 0 and computed == len(ids)
    assert a == b


def test_shared_system_prompt_is_reused_across_different_requests(engine: Engine) -> None:
    system = _prompt(engine, n_blocks=4, seed=4)[:64]
    first = system + engine.tokenizer.encode(" Question one: what is the capital of France?")
    second = system + engine.tokenizer.encode(" Question two: name a prime number.")
    _run(engine, first, salt="t-system")
    _, computed, cached = _run(engine, second, salt="t-system")
    assert cached == 64 and computed == len(second) - 64


def test_tokens_reach_the_right_requests_when_a_one_token_chunk_follows_a_prefill(engine: Engine) -> None:
    """Regression: the runner puts single-token entries first; sampled tokens must still be
    returned in scheduler order (a 1-token prompt admitted after a longer one swapped tokens)."""
    long_first = engine.tokenizer.encode("The capital of France is")
    one_token = engine.tokenizer.encode("Hi")[:1]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = [engine.generate([p], params)[0].output_ids for p in (long_first, one_token)]
    together = [r.output_ids for r in engine.generate([long_first, one_token], params)]
    assert together == alone
