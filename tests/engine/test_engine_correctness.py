"""The engine against a reference nobody here wrote, and against itself.

* Hugging Face transformers (fp32, the same GGUF) is the oracle: our greedy tokens equal its
  greedy tokens, and our logits equal its logits at every position within `LOGIT_ATOL`.
* Batching, chunked prefill and preemption-by-recompute do not change a request's tokens.
* Stop conditions (stop strings, stop token ids, EOS, max_tokens) and cancellation.

Tolerance, measured on this machine (fp32, CPU): a single prefill through `DecoderModel.forward`
matches HF's logits bit for bit (max |diff| = 0); the logits the engine samples from during
decode (paged KV, batched and chunked) differ from HF's full forward by at most ~1e-4, with
|logits| up to ~43. `LOGIT_ATOL` allows 10x that. Every prompt's HF greedy path keeps a top-1 vs
top-2 gap above `MIN_MARGIN` > 2 * LOGIT_ATOL, so logits within tolerance cannot flip a token.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import halfmoon.engine.runner as runner_module
from halfmoon.core.messages import TokenChunk
from halfmoon.core.params import FinishReason, SamplingParams
from halfmoon.engine.engine import Engine
from halfmoon.engine.outputs import CompletionResult, completion_result
from halfmoon.engine.quality import prefill_logits  # one prefill, logits at every position
from halfmoon.engine.request import Request
from halfmoon.engine.scheduler import ScheduledRequest
from tests.conftest import EngineFactory, assert_engine_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_NEW = 48
BATCH_NEW = 20
LOGIT_ATOL = 1e-3
MIN_MARGIN = 5e-3

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
ORACLE_PROMPTS: dict[str, str | list[dict[str, str]]] = {
    "story": "The old lighthouse keeper looked out at the sea and",
    "code": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "math": "Q: A train travels 60 miles per hour for 3 hours. How far does it go?\nA:",
    "chat": CHAT,
    "list": "Here is a list of fruits:\n1. Apple\n2. Banana\n3.",
}
LONG_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press into a system that could "
    "produce books far faster than any scribe. Within fifty years, presses had spread to more than "
    "two hundred cities across Europe, and millions of volumes were in circulation. The effects "
    "reached every part of society: scholars could compare identical copies of a text, merchants "
    "printed price lists and contracts, and reformers distributed pamphlets to audiences that had "
    "never owned a book before. Historians still debate how quickly literacy rose, but few doubt "
    "that the press changed how knowledge was stored, shared and argued about. In the centuries "
    "that followed, newspapers, encyclopedias and cheap novels all grew out of the same machine."
)
BATCH_TEXTS = [
    "Hi",
    "The capital of France is",
    "import numpy as np\nimport torch\n\nclass Model(torch.nn.Module):\n    def __init__(self):",
    "Ingredients for pancakes:\n-",
    "1, 1, 2, 3, 5, 8,",
    "Dear hiring manager, I am writing to apply for the position of",
    LONG_TEXT,
    "Translate to French: good morning ->",
]


def encode(engine: Engine, prompt: str | list[dict[str, str]]) -> list[int]:
    text = prompt if isinstance(prompt, str) else engine.tokenizer.apply_chat_template(prompt)
    return engine.tokenizer.encode(text)


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=kw.pop("ignore_eos", True), **kw)


def outputs(results: list[CompletionResult]) -> list[list[int]]:
    return [r.output_ids for r in results]


# ---------------------------------------------------------------- the oracle


@dataclass(frozen=True)
class OracleRun:
    prompt: list[int]
    tokens: list[int]  # HF greedy continuation, NUM_NEW tokens, EOS treated as any token
    margins: list[float]  # top-1 minus top-2 logit at each greedy step
    logits: torch.Tensor  # HF logits at every position of prompt + tokens: [n, vocab]


@pytest.fixture(scope="module")
def hf_model(gguf_path: Path, shared_engine: Engine) -> Any:
    """transformers' Llama on the same GGUF, fp32 (its own conversion, ~15 s, cached per machine by
    bench/hf_reference.py).

    Requested after `shared_engine` so the oracle also runs with the tests' single torch thread.
    """
    pytest.importorskip("transformers")
    from halfmoon.bench.hf_reference import hf_model

    return hf_model(gguf_path, torch.float32)


@pytest.fixture(scope="module")
def oracle(hf_model: Any, shared_engine: Engine) -> dict[str, OracleRun]:
    return {name: hf_greedy(hf_model, encode(shared_engine, prompt))
            for name, prompt in ORACLE_PROMPTS.items()}


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int]) -> OracleRun:
    """Greedy decoding with HF's own KV cache (what generate(do_sample=False) does, minus EOS)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    margins: list[float] = []
    for _ in range(NUM_NEW):
        last = out.logits[0, -1]
        top2 = last.topk(2).values
        margins.append(float(top2[0] - top2[1]))
        tokens.append(int(last.argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                    use_cache=True)
    full = model(torch.tensor([prompt + tokens])).logits[0].float()
    return OracleRun(prompt, tokens, margins, full)


@pytest.fixture
def sampled_logits(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Records, per request id, every logits row the engine samples from."""
    seen: dict[str, list[torch.Tensor]] = {}
    real_sample = runner_module.sample

    def spy(logits: torch.Tensor, requests: list[Request]) -> list[int]:
        for row, req in zip(logits, requests, strict=True):
            seen.setdefault(req.request_id, []).append(row.clone())
        return real_sample(logits, requests)

    monkeypatch.setattr(runner_module, "sample", spy)
    yield seen


@pytest.mark.parametrize("name", ORACLE_PROMPTS)
def test_oracle_greedy_path_is_not_near_tied(oracle: dict[str, OracleRun], name: str) -> None:
    # If this fails the prompt is a coin flip for any implementation: swap it, do not loosen.
    run = oracle[name]
    worst = min(range(NUM_NEW), key=lambda i: run.margins[i])
    gap = run.margins[worst]
    assert gap > MIN_MARGIN, f"{name}: top-2 gap {gap:.2e} at step {worst}"


@pytest.mark.parametrize("name", ORACLE_PROMPTS)
def test_greedy_matches_hf(engine: Engine, oracle: dict[str, OracleRun], name: str,
                           sampled_logits: dict[str, list[torch.Tensor]]) -> None:
    run = oracle[name]
    [result] = engine.generate([run.prompt], greedy(NUM_NEW))
    assert result.prompt_ids == run.prompt
    assert result.output_ids == run.tokens, engine.tokenizer.decode(result.output_ids)
    assert result.finish_reason is FinishReason.LENGTH
    # The logits the engine actually sampled from (prefill, then paged decode) vs HF's.
    ours = torch.stack(sampled_logits[result.request_id])
    theirs = run.logits[len(run.prompt) - 1 : -1]
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < LOGIT_ATOL


@pytest.mark.parametrize("name", ORACLE_PROMPTS)
def test_logits_match_hf_at_every_position(engine: Engine, oracle: dict[str, OracleRun],
                                           name: str) -> None:
    run = oracle[name]
    ours = prefill_logits(engine, run.prompt + run.tokens)
    assert ours.shape == run.logits.shape
    diff = (ours - run.logits).abs().max(dim=-1).values
    worst = int(diff.argmax())
    assert diff[worst].item() < LOGIT_ATOL, f"{name}: |diff| {diff[worst]:.2e} at position {worst}"


def test_chat_prompt_uses_the_template(oracle: dict[str, OracleRun], shared_engine: Engine) -> None:
    text = shared_engine.tokenizer.decode(oracle["chat"].prompt, skip_special=False)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------- the engine against itself


@pytest.fixture
def step_log(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[str, int]]]:
    """Records each step's batch as (request id, tokens computed) pairs."""
    log: list[list[tuple[str, int]]] = []
    real_run = engine.runner.run

    def spy(scheduled: list[ScheduledRequest]) -> list[int]:
        log.append([(s.request.request_id, s.num_tokens) for s in scheduled])
        return real_run(scheduled)

    monkeypatch.setattr(engine.runner, "run", spy)
    return log


def test_batched_equals_alone(engine: Engine, step_log: list[list[tuple[str, int]]]) -> None:
    prompts = [engine.tokenizer.encode(t) for t in BATCH_TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts)  # all lengths differ
    alone = [outputs(engine.generate([p], greedy(BATCH_NEW)))[0] for p in prompts]
    step_log.clear()
    batched = engine.generate(prompts, greedy(BATCH_NEW))
    assert outputs(batched) == alone
    # They really ran as one batch: one prefill step, then every step decoded all eight.
    assert len(step_log) == BATCH_NEW and all(len(step) == len(prompts) for step in step_log)


def long_prompt(engine: Engine) -> list[int]:
    ids = engine.tokenizer.encode(LONG_TEXT)
    assert len(ids) >= 150
    return ids[:150]


def chunks_of(log: list[list[tuple[str, int]]], request_id: str) -> list[int]:
    return [n for step in log for rid, n in step if rid == request_id]


@pytest.mark.parametrize("budget", [16, 64])
def test_chunked_prefill_matches_unchunked(engine: Engine, budget: int,
                                           step_log: list[list[tuple[str, int]]]) -> None:
    prompt = long_prompt(engine)
    short = engine.tokenizer.encode("The capital of France is")
    assert engine.scheduler.max_num_batched_tokens >= len(prompt) + len(short)
    unchunked_alone = outputs(engine.generate([prompt], greedy(16)))
    unchunked_pair = outputs(engine.generate([short, prompt], greedy(16)))
    engine.scheduler.max_num_batched_tokens = budget  # the engine fixture restores it
    step_log.clear()
    # Fresh cache salts: the runs above cached this prompt, and a prefix hit would skip the chunks.
    [alone] = engine.generate([prompt], greedy(16), cache_salt=f"chunk-alone-{budget}")
    assert [alone.output_ids] == unchunked_alone
    full, rest = divmod(len(prompt), budget)
    assert chunks_of(step_log, alone.request_id) == [budget] * full + [rest] * (rest > 0) + [1] * 15
    # The short request first: its decodes share steps with the long prompt's chunks.
    step_log.clear()
    pair = engine.generate([short, prompt], greedy(16), cache_salt=f"chunk-pair-{budget}")
    assert outputs(pair) == unchunked_pair
    first, second = (r.request_id for r in pair)
    mixed = [s for s in map(dict, step_log) if s.get(first) == 1 and s.get(second, 0) > 1]
    assert mixed, "no step ran a decode next to a prefill chunk"
    assert all(sum(n for _, n in step) <= budget for step in step_log)


@pytest.fixture(scope="module")
def tiny_engine(make_engine: EngineFactory) -> Engine:
    # 8 blocks x 16 = 128 tokens of KV: room for about one and a half of the requests below.
    return make_engine(num_blocks=8)


def test_preempted_requests_match_unpreempted(engine: Engine, tiny_engine: Engine) -> None:
    prompts = [engine.tokenizer.encode(t) for t in BATCH_TEXTS[1:5]]
    params = greedy(48)
    assert all(len(p) + 48 <= 128 for p in prompts)
    reference = engine.generate(prompts, params)
    assert all(r.num_preemptions == 0 for r in reference)
    order = [tiny_engine.add_request(p, params) for p in prompts]
    chunks: dict[str, list[TokenChunk]] = {request_id: [] for request_id in order}
    while tiny_engine.has_unfinished():
        for out in tiny_engine.step():
            chunks[out.request_id].append(out)
        tiny_engine.pool.check_integrity()
    results = [completion_result(rid, p, chunks[rid]) for rid, p in zip(order, prompts)]
    assert max(r.num_preemptions for r in results) > 0
    assert outputs(results) == outputs(reference)
    assert [r.text for r in results] == [r.text for r in reference]
    assert_engine_idle(tiny_engine)


# ---------------------------------------------------------------- stop conditions


LIST_PROMPT = "Here is a list of fruits:\n1. Apple\n2. Banana\n3."


def test_stop_strings_end_the_text_before_them(engine: Engine) -> None:
    prompt = engine.tokenizer.encode(LIST_PROMPT)
    [free] = engine.generate([prompt], greedy(24))
    assert free.text.startswith(" Orange\n4. Grape\n5.")  # what the stops below cut
    stops = [greedy(24, stop=("Grape",)), greedy(24, stop=("ape\n5", "nothing like this")),
             greedy(24, stop=("zzz",))]
    results = engine.generate([prompt] * 3, stops)
    assert [r.text for r in results[:2]] == [" Orange\n4. ", " Orange\n4. Gr"]
    assert [r.finish_reason for r in results] == [FinishReason.STOP] * 2 + [FinishReason.LENGTH]
    for r, stop in zip(results[:2], ("Grape", "ape\n5"), strict=True):
        # The tokens end with the one that completed the stop string.
        assert r.output_ids == free.output_ids[: len(r.output_ids)]
        assert stop in engine.tokenizer.decode(r.output_ids)
        assert stop not in engine.tokenizer.decode(r.output_ids[:-1])
    assert results[2].output_ids == free.output_ids


def test_streamed_text_holds_back_a_possible_stop_string(engine: Engine) -> None:
    prompt = engine.tokenizer.encode(LIST_PROMPT)
    request_id = engine.add_request(prompt, greedy(24, stop=("ape\n5",)))
    chunks: list[TokenChunk] = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == request_id
            chunks.append(out)
    deltas = [c.text for c in chunks]
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert "".join(deltas) == completion_result(request_id, prompt, chunks).text == " Orange\n4. Gr"
    assert not any("ape" in d for d in deltas)  # never streamed, then taken back


def test_stop_token_ids(engine: Engine) -> None:
    prompt = engine.tokenizer.encode(LIST_PROMPT)
    [free] = engine.generate([prompt], greedy(24))
    stop_at = free.output_ids[5]
    first = free.output_ids.index(stop_at)
    [r] = engine.generate([prompt], greedy(24, stop_token_ids=(stop_at, 49151)))
    assert r.finish_reason is FinishReason.STOP
    assert r.output_ids == free.output_ids[: first + 1]


def test_eos_stops_unless_ignored(engine: Engine) -> None:
    prompt = encode(engine, CHAT)
    eos = engine.tokenizer.eos_id
    [stopped] = engine.generate([prompt], greedy(NUM_NEW, ignore_eos=False))
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.output_ids[-1] == eos and eos not in stopped.output_ids[:-1]
    assert stopped.text == "The capital of France is Paris."  # EOS is special: not in the text
    n = len(stopped.output_ids) + 5
    [ignored] = engine.generate([prompt], greedy(n, ignore_eos=True))
    assert ignored.finish_reason is FinishReason.LENGTH
    assert len(ignored.output_ids) == n
    assert ignored.output_ids[: len(stopped.output_ids)] == stopped.output_ids


def test_max_tokens_gives_length(engine: Engine) -> None:
    prompt = engine.tokenizer.encode("Once upon a time")
    for n in (1, 7):
        [r] = engine.generate([prompt], greedy(n))
        assert (len(r.output_ids), r.finish_reason) == (n, FinishReason.LENGTH)
        assert r.ttft_ms > 0 and r.tpot_ms >= 0 and (r.tpot_ms > 0) == (n > 1)


def test_abort_mid_generation_frees_blocks(engine: Engine) -> None:
    prompt = engine.tokenizer.encode(LONG_TEXT)
    other = engine.tokenizer.encode("The capital of France is")
    [reference] = outputs(engine.generate([other], greedy(12)))
    victim = engine.add_request(prompt, greedy(200))
    survivor = engine.add_request(other, greedy(12))
    streamed: dict[str, list[int]] = {victim: [], survivor: []}
    for _ in range(4):
        for out in engine.step():
            streamed[out.request_id] += out.token_ids
    assert len(streamed[victim]) == 4
    assert engine.pool.num_free() < engine.pool.num_blocks
    engine.abort(victim)
    engine.abort("no-such-request")  # unknown ids are ignored
    finals = {}
    for out in engine.step():  # the abort takes effect at the start of this step
        streamed[out.request_id] += out.token_ids
        if out.end is not None:
            finals[out.request_id] = out.end
    assert finals[victim].finish_reason is FinishReason.ABORT
    assert finals[victim].usage.completion_tokens == len(streamed[victim])
    assert len(streamed[victim]) == 4
    engine.pool.check_integrity()
    survivor_blocks = engine.scheduler.requests[survivor].block_table
    assert engine.pool.num_used() == len(survivor_blocks) > 0
    while engine.has_unfinished():
        for out in engine.step():
            streamed[out.request_id] += out.token_ids
            if out.end is not None:
                finals[out.request_id] = out.end
    assert finals[survivor].finish_reason is FinishReason.LENGTH
    assert streamed[survivor] == reference
    engine.pool.check_integrity()
    assert engine.pool.num_free() == engine.pool.num_blocks


def test_abort_before_the_first_step(engine: Engine) -> None:
    request_id = engine.add_request(engine.tokenizer.encode("Hello"), greedy(8))
    engine.abort(request_id)
    [out] = engine.step()
    assert out.end is not None and out.end.finish_reason is FinishReason.ABORT
    assert out.token_ids == [] and out.end.usage.completion_tokens == 0
    assert engine.pool.num_free() == engine.pool.num_blocks
