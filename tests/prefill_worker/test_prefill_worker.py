"""The prefill worker driven directly, beside a real decode worker: no Ray, no Conductor.

Each test does what the Conductor does for a request (`reserve` on the decode worker, then
`prefill` and `generate` at once) and checks the outcome against one engine running the same
request, and that both workers end idle: nothing watched or reserved, every block free, pools
consistent.
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
import torch

from halfmoon.engine.lora import lora_shapes
from halfmoon.core.messages import (DecodeTask, KVTransferFailedError, EngineInfo, PrefillFailedError,
                           PrefillTask, WorkerLoad)
from halfmoon.core.params import FinishReason, SamplingParams
from halfmoon.engine.engine import Engine
from tests.waiting import wait_until
from tests.workers_support import (TIMEOUT_S, InProcessWorkers, drain, run_pair,
                                   tokens)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PROMPT = "The capital of France is"


def test_a_pair_is_token_identical_to_one_engine(workers: InProcessWorkers, engine: Engine) -> None:
    prompt = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = engine.generate([prompt], params)[0].output_ids

    result, chunks = asyncio.run(run_pair(workers.prefill, workers.decode, "greedy", prompt, params))

    assert tokens(chunks) == expected
    assert result.request_id == "greedy" and result.first_token == expected[0]
    assert [c.end is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    end = chunks[-1].end
    assert end is not None and end.finish_reason is FinishReason.LENGTH
    assert end.usage.completion_tokens == params.max_tokens


def test_seeded_sampling_continues_across_the_pair(workers: InProcessWorkers, engine: Engine) -> None:
    """The prefill worker samples the first token; the generator state travels with the KV
    (PrefilledKV), so the decode worker continues the same random sequence."""
    prompt = engine.tokenizer.encode("Once upon a time, in a land far away,")
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=1234, ignore_eos=True)
    expected = engine.generate([prompt], params)[0].output_ids
    greedy = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].output_ids
    assert expected != greedy, "the seed samples the greedy path: this test would prove nothing"

    _, chunks = asyncio.run(run_pair(workers.prefill, workers.decode, "seeded", prompt, params))

    assert tokens(chunks) == expected


def test_an_aborted_prefill_fails_and_frees_its_blocks(workers: InProcessWorkers, engine: Engine) -> None:
    """Cancelled mid-prefill (the Conductor's `decode.cancel` + `prefill.abort`): the prefill
    raises, the decode stream raises, and both workers give every block back."""
    p, d = workers.prefill, workers.decode
    # ~700 tokens in chunks of 64: the abort lands while most of the prompt is still to compute.
    prompt = engine.tokenizer.encode("Please explain in detail." * 140)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    computed = p.engine_load().prompt_tokens_computed

    async def run() -> list[BaseException | object]:
        handoff = await d.reserve("aborted", len(prompt), params.max_tokens, TIMEOUT_S)
        task = PrefillTask("aborted", prompt, params, None, handoff, TIMEOUT_S)
        prefill = asyncio.ensure_future(p.prefill(task))
        stream = asyncio.ensure_future(drain(d.generate(DecodeTask("aborted", prompt, params, None, TIMEOUT_S))))
        await asyncio.to_thread(wait_until, lambda: p.engine_load().prompt_tokens_computed > computed,
                                TIMEOUT_S, "the first prefill chunk")
        await d.cancel("aborted")
        await p.abort("aborted")
        return await asyncio.gather(prefill, stream, return_exceptions=True)

    prefill_outcome, decode_outcome = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))

    assert isinstance(prefill_outcome, (PrefillFailedError, KVTransferFailedError)), prefill_outcome
    assert isinstance(decode_outcome, KVTransferFailedError), decode_outcome
    assert p.engine_load().prompt_tokens_computed - computed < len(prompt), "the prefill ran to its end"


def test_a_corrupted_push_fails_both_sides(workers: InProcessWorkers, engine: Engine) -> None:
    """A flipped bit in one KV unit: the decode side's checksum catches it, both verbs raise
    KVTransferFailedError (the Conductor may re-run the request), nothing stays reserved."""
    p, d = workers.prefill, workers.decode
    prompt = engine.tokenizer.encode("def fibonacci(n):")
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def run() -> list[BaseException | object]:
        await p.corrupt_next_push("corrupt")
        handoff = await d.reserve("corrupt", len(prompt), params.max_tokens, TIMEOUT_S)
        prefill = p.prefill(PrefillTask("corrupt", prompt, params, None, handoff, TIMEOUT_S))
        stream = drain(d.generate(DecodeTask("corrupt", prompt, params, None, TIMEOUT_S)))
        return await asyncio.gather(prefill, stream, return_exceptions=True)

    prefill_outcome, decode_outcome = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))

    assert isinstance(prefill_outcome, KVTransferFailedError), prefill_outcome
    assert isinstance(decode_outcome, KVTransferFailedError), decode_outcome


def test_model_info_and_load_describe_the_engine(workers: InProcessWorkers) -> None:
    p = workers.prefill

    async def ask() -> tuple[EngineInfo, WorkerLoad, str | None]:
        return await p.engine_info(), await p.load(), await p.block_address()

    info, load, block_address = asyncio.run(ask())

    e = p.engine
    assert info == EngineInfo(e.max_model_len, e.model_config.vocab_size, e.model_config.fingerprint,
                             e.config.block_size, "float32", info.kv_bytes_per_token, "llama",
                             lora_shapes(e.model_config, info.lora.base_names if info.lora else ()), 16,
                             "cpu", socket.gethostname(), len(os.sched_getaffinity(0)), torch.get_num_threads())
    assert info.lora is not None and "smollm2" in info.lora.base_names  # what an adapter's base is checked against
    assert info.kv_bytes_per_token == e.model_config.num_layers * 2 * e.model_config.num_kv_heads \
        * e.model_config.head_dim * 4
    assert load.alive and load.failure is None
    assert (load.free_blocks, load.total_blocks) == (e.pool.num_blocks, e.pool.num_blocks)
    assert (load.requests, load.pending_tokens, load.reserved, load.kv_address) == (0, 0, 0, None)
    assert block_address is None  # no host/disk tier or index: nothing to serve


def test_logprobs_and_penalties_across_the_pair_equal_one_engine(workers: InProcessWorkers, engine: Engine) -> None:
    """The prefill worker samples the first token with the penalties and biases and computes its
    logprobs; they travel with the KV (PrefilledKV.first_logprobs) and the decode worker goes on
    with the same processing: tokens and every logprob as one engine gives them (issue 46)."""
    prompt = engine.tokenizer.encode("one two three one two three one two three")
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=4, frequency_penalty=0.9, presence_penalty=0.4,
                            repetition_penalty=1.2, logit_bias={28: 2.5}, min_tokens=2, prompt_logprobs=3)
    expected = engine.generate([prompt], params)[0]

    _, chunks = asyncio.run(run_pair(workers.prefill, workers.decode, "processed", prompt, params))

    assert tokens(chunks) == expected.output_ids
    got = [lp for c in chunks for lp in c.logprobs or ()]
    assert len(got) == 8 and expected.logprobs is not None
    for a, b in zip(got, expected.logprobs):
        assert abs(a.logprob - b.logprob) < 1e-4 and [i for i, _ in a.top] == [i for i, _ in b.top]
    prompt = [lp for c in chunks for lp in c.prompt_logprobs or ()]  # computed on the prefill worker
    assert expected.prompt_logprobs is not None and len(prompt) == len(expected.prompt_logprobs) > 0
    assert all(abs(a.logprob - b.logprob) < 1e-4 and a.top[0][0] == b.top[0][0]
               for a, b in zip(prompt, expected.prompt_logprobs))


def test_n_choices_cross_the_pair_with_one_prefill_and_one_transfer(workers: InProcessWorkers,
                                                                    engine: Engine) -> None:
    """n = 3, seeded: the prefill worker computes the prompt once and samples every choice's
    first token; one KV transfer (the bytes of an n = 1 request) reaches the decode worker,
    where the choices fork from the prompt's blocks: each choice as one engine gives it."""
    prompt = engine.tokenizer.encode("Once upon a time, in a land far away,")
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=77, n=3, ignore_eos=True, logprobs=1)
    expected = engine.generate_choices(prompt, params)
    p, d = workers.prefill, workers.decode

    def received() -> int:
        return asyncio.run(d.load()).kv_bytes_received

    start = received()
    asyncio.run(run_pair(p, d, "single", prompt, SamplingParams(max_tokens=2)))
    one = received() - start
    computed = p.engine.scheduler.stats.prompt_tokens_computed
    _, chunks = asyncio.run(run_pair(p, d, "choices", prompt, params))
    assert received() - start - one == one > 0, "n = 3 sent other than one prompt's KV"
    assert p.engine.scheduler.stats.prompt_tokens_computed - computed <= len(prompt)
    for i, want in enumerate(expected):
        mine = [c for c in chunks if c.index == i]
        assert tokens(mine) == want.output_ids, i
        assert [round(lp.logprob, 4) for c in mine for lp in c.logprobs or ()] == \
            [round(lp.logprob, 4) for lp in want.logprobs or ()]
    assert chunks[-1].end is not None and chunks[-1].end.usage.completion_tokens == 18
