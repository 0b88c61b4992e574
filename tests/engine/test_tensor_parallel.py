"""Tensor-parallel engines on CPU: two processes over gloo (engine/parallel.py, engine/tp_ranks.py).

* fp32: TP=2 greedy decoding is token-identical to TP=1 for SmolLM2 (3 KV heads over 2 ranks:
  an uneven split, 2 + 1) and the tiny random-weight families (Qwen3's one KV head replicated
  on both ranks; Gemma 3's and Mistral's sliding windows; Qwen2's q/k/v bias; dynamic NTK RoPE).
  Logits differ only by the order of fp32 sums (measured <= 1e-5 on the families, 6e-5 on
  SmolLM2).
* int8 / int4: each shard holds exactly the unsharded layer's weights (int4: the same groups of
  32; int8: each row keeps the whole row's scale). Token identity does not hold, and cannot:
  torch's int8 kernel returns bf16, so a row-parallel layer's two partial sums are each rounded
  to bf16 where TP=1 rounds their sum; the native int4 kernel quantizes its input activations to
  int8, so a 1e-6 difference flips roundings that compound over the layers. Measured on SmolLM2
  (TP=1, its embeddings perturbed by 1e-6 relative): logits move by 0.05 mean for int8, 0.45
  for int4 (top-1 0.80) — the same size as TP=2 vs TP=1 (0.10 and 0.41, top-1 1.0 and 0.96). So
  quantized TP=2 is compared to quantized TP=1 teacher-forced (both score the same tokens),
  with bounds a little above those measurements; a wrong shard or a missing all_reduce moves
  logits by whole units and top-1 agreement to near chance.
* A rank killed or stopped fails rank 0's step with `RankLostError` naming it, in bounded time.
"""

from __future__ import annotations

import itertools

import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

import halfmoon.engine.parallel as parallel
from halfmoon.core.errors import ConfigError
from halfmoon.core.params import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.engine.quality import perplexity, prefill_logits
from halfmoon.engine.errors import RankLostError, ShardingError
from halfmoon.engine.model_config import ModelConfig
from halfmoon.engine.parallel import plan_shard, span
from halfmoon.engine.request import Request
from halfmoon.engine.scheduler import ScheduledRequest
from halfmoon.engine.tp_ranks import decode_step, encode_step
from tests.conftest import NUM_THREADS, assert_engine_idle
from tests.model_families import BY_NAME, NEW, build_checkpoint, prompts

pytestmark = [pytest.mark.timeout(300)]

SMOL_PROMPTS = [[1, 504, 3458, 282, 4649, 314, 1439, 28, 253], [1, 1073, 314, 253, 1479, 30, 436]]
SMOL_NEW = 16
FAMILIES = ("llama", "llama-dynamic-rope", "mistral", "qwen2", "qwen3", "gemma3")
# (top-1 agreement at least, mean |logit difference| at most, max at most): see the docstring
QUANTIZED_BOUNDS = {"int8": (0.95, 0.2, 2.0), "int4": (0.9, 0.6, 6.0)}
# the tiny families (measured: top-1 >= 0.984, max |difference| <= 0.16, one or two bf16 steps)
FAMILY_QUANTIZED_BOUNDS = (0.95, 0.1, 0.5)
FAIL_WITHIN_S = 30.0  # a lost rank fails the step well inside this


def tp_engine(model: str, **overrides: Any) -> Engine:
    return Engine(EngineConfig(**{"model": model, "num_blocks": 64, "num_threads": NUM_THREADS,
                                  "max_num_batched_tokens": 32, **overrides}))


def greedy(engine: Engine, prompt_ids: list[list[int]], new: int) -> list[list[int]]:
    return [r.output_ids for r in engine.generate(prompt_ids, SamplingParams(max_tokens=new, ignore_eos=True))]


def compare_forced(reference: Engine, engine: Engine, sequences: list[list[int]],
                   bounds: tuple[float, float, float]) -> None:
    want = [prefill_logits(reference, ids) for ids in sequences]
    got = [prefill_logits(engine, ids) for ids in sequences]
    diff = torch.cat([(a - b).abs().flatten() for a, b in zip(got, want)])
    top1 = torch.cat([(a.argmax(-1) == b.argmax(-1)).float() for a, b in zip(got, want)]).mean().item()
    least_top1, most_mean, most_max = bounds
    assert top1 >= least_top1 and diff.mean() <= most_mean and diff.max() <= most_max, \
        (top1, diff.mean().item(), diff.max().item())


# ---------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smol_tp2() -> Iterator[Engine]:
    engine = tp_engine("smollm2", tp=2)
    yield engine
    engine.close()


def test_smollm2_tp2_is_token_identical_to_tp1(engine: Engine, smol_tp2: Engine) -> None:
    # rank 0 holds KV heads 0-1 (and query heads 0-5) of 3; rank 1 head 2 (query heads 6-8)
    assert smol_tp2.kv_cache.shape[-2] == 2 and smol_tp2.model.num_heads == 6
    assert greedy(smol_tp2, SMOL_PROMPTS, SMOL_NEW) == greedy(engine, SMOL_PROMPTS, SMOL_NEW)
    assert_engine_idle(smol_tp2)
    group = smol_tp2.model.group
    assert group is not None and group.backend == "gloo" and group.calls > 0


def test_quality_measures_run_on_a_tp_engine(engine: Engine, smol_tp2: Engine) -> None:
    """engine/quality.py's teacher-forced prefill steps the ranks too (it hung on rank 0's
    collectives when it ran a scratch cache of rank 0's alone)."""
    ids = SMOL_PROMPTS[0] + greedy(engine, SMOL_PROMPTS[:1], SMOL_NEW)[0]
    assert perplexity(smol_tp2, ids) == pytest.approx(perplexity(engine, ids), rel=1e-3)
    assert_engine_idle(smol_tp2)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_smollm2_quantized_shards_stay_within_tolerance(engine: Engine, quantization: str) -> None:
    sequences = [p + o for p, o in zip(SMOL_PROMPTS, greedy(engine, SMOL_PROMPTS, SMOL_NEW))]
    one, two = tp_engine("smollm2", quantization=quantization), tp_engine("smollm2", quantization=quantization, tp=2)
    try:
        compare_forced(one, two, sequences, QUANTIZED_BOUNDS[quantization])
        assert len(greedy(two, SMOL_PROMPTS[:1], 4)[0]) == 4  # its decode steps run too
    finally:
        one.close()
        two.close()


# ---------------------------------------------------------------- the tiny families


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-families")
    built = {}
    for name in FAMILIES:
        build_checkpoint(BY_NAME[name], root / name)
        built[name] = root / name
    return built


@pytest.mark.parametrize("name", FAMILIES)
def test_family_tp2_is_token_identical_to_tp1(folders: dict[str, Path], name: str) -> None:
    one = tp_engine(str(folders[name]))
    expected = greedy(one, prompts(2), NEW)
    one.close()
    two = tp_engine(str(folders[name]), tp=2)
    try:
        assert greedy(two, prompts(2), NEW) == expected
        assert_engine_idle(two)
    finally:
        two.close()


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_family_quantized_shards_stay_within_tolerance(folders: dict[str, Path], name: str, quantization: str) -> None:
    one = tp_engine(str(folders[name]), quantization=quantization)
    two = tp_engine(str(folders[name]), quantization=quantization, tp=2)
    try:
        sequences = [p + o for p, o in zip(prompts(2), greedy(one, prompts(2), NEW))]
        compare_forced(one, two, sequences, FAMILY_QUANTIZED_BOUNDS)
    finally:
        one.close()
        two.close()


# ---------------------------------------------------------------- a rank lost


def _step_in_thread(engine: Engine) -> Future[object]:
    """`engine.step()` on a thread of its own: a hang shows as a timeout, not a stuck test."""
    future: Future[object] = Future()

    def run() -> None:
        try:
            future.set_result(engine.step())
        except BaseException as e:  # handed to the test
            future.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return future


def test_a_killed_rank_fails_rank_0s_step_naming_it(folders: dict[str, Path]) -> None:
    engine = tp_engine(str(folders["llama"]), tp=2)
    try:
        assert engine.ranks is not None
        assert len(greedy(engine, prompts(1), 2)[0]) == 2
        os.kill(engine.ranks.pids()[0], signal.SIGKILL)
        engine.add_request(prompts(1)[0], SamplingParams(max_tokens=4))
        with pytest.raises(RankLostError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            _step_in_thread(engine).result(FAIL_WITHIN_S)
        with pytest.raises(RankLostError):  # and every step after it, at once
            _step_in_thread(engine).result(FAIL_WITHIN_S)
    finally:
        engine.close()


def test_a_stalled_rank_fails_rank_0s_step_at_the_collective_timeout(folders: dict[str, Path],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "COLLECTIVE_TIMEOUT_S", 3.0)
    engine = tp_engine(str(folders["llama"]), tp=2)
    try:
        assert engine.ranks is not None
        os.kill(engine.ranks.pids()[0], signal.SIGSTOP)
        engine.add_request(prompts(1)[0], SamplingParams(max_tokens=4))
        with pytest.raises(RankLostError, match="every rank's process is running"):
            _step_in_thread(engine).result(FAIL_WITHIN_S)
    finally:
        os.kill(engine.ranks.pids()[0], signal.SIGKILL)
        engine.close()


# ---------------------------------------------------------------- sharding rules and packets


def _cfg(heads: int, kv: int, head_dim: int = 64, intermediate: int = 1536, vocab: int = 49152) -> ModelConfig:
    return ModelConfig("llama", 2, heads * head_dim, heads, kv, head_dim, intermediate, vocab, 1e4, 1e-5, 128,
                       True, 1, 2)


def test_kv_heads_split_unevenly_with_their_query_groups() -> None:
    shards = [plan_shard(_cfg(9, 3), r, 2) for r in range(2)]
    assert [(s.q_heads, s.kv_heads) for s in shards] == [(slice(0, 6), slice(0, 2)), (slice(6, 9), slice(2, 3))]
    assert [s.ffn for s in shards] == [slice(0, 768), slice(768, 1536)]
    assert [span(10, r, 3) for r in range(3)] == [slice(0, 4), slice(4, 7), slice(7, 10)]


def test_fewer_kv_heads_than_ranks_replicate_them() -> None:
    shards = [plan_shard(_cfg(8, 2), r, 4) for r in range(4)]
    assert [s.kv_heads.start for s in shards] == [r * 2 // 4 for r in range(4)]
    assert [s.q_heads for s in shards] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    with pytest.raises(ShardingError, match="multiple of num_kv_heads"):
        plan_shard(_cfg(6, 2), 0, 3)
    with pytest.raises(ShardingError, match="do not split"):
        plan_shard(_cfg(2, 1), 0, 4)


def test_int4_needs_shards_on_group_boundaries() -> None:
    plan_shard(_cfg(4, 2, head_dim=16, intermediate=128), 0, 2, "int4")  # 2 heads x 16 = 32 columns
    with pytest.raises(ShardingError, match="groups"):
        plan_shard(_cfg(4, 4, head_dim=16, intermediate=128), 0, 4, "int4")  # 16 columns per rank


def test_step_packets_carry_every_input(engine: Engine) -> None:
    """A mixed step (decodes, a chunk after a cached prefix) survives the packet exactly."""
    def request(n: int, computed: int, blocks: list[int]) -> Request:
        req = Request(f"r{n}", list(range(3, 3 + n)), SamplingParams(), n, torch.Generator())
        req.block_table, req.num_computed_tokens = blocks, computed
        return req

    scheduled = [ScheduledRequest(request(20, 19, [4, 7]), 1, True), ScheduledRequest(request(5, 2, [9]), 1, True),
                 ScheduledRequest(request(40, 16, [1, 2, 3]), 24, True)]
    sent = engine.runner.prepare(scheduled)
    got = decode_step(encode_step(sent))
    assert got is not None
    for name in ("input_ids", "positions", "logits_rows"):
        assert torch.equal(getattr(got, name), getattr(sent, name)), name
    assert torch.equal(got.meta.slot_mapping, sent.meta.slot_mapping) and got.meta.num_tokens == sent.meta.num_tokens
    a, b = got.meta.decode, sent.meta.decode
    assert a is not None and b is not None and (a.num, a.max_ctx) == (b.num, b.max_ctx)
    assert torch.equal(a.block_tables, b.block_tables) and torch.equal(a.ctx_lens, b.ctx_lens)
    assert torch.equal(a.mask, b.mask)
    (p,), (q,) = got.meta.prefills, sent.meta.prefills
    assert (p.q_start, p.q_len, p.ctx_len) == (q.q_start, q.q_len, q.ctx_len)
    assert torch.equal(p.block_table, q.block_table) and torch.equal(p.mask, q.mask)


def test_tp_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="tp must be > 0"):
        EngineConfig(tp=0)
    assert EngineConfig(tp=2, host_cache_gb=1.0, disk_cache_dir="/tmp/x", disk_cache_gb=1.0).tp == 2  # built now


def test_the_bench_counts_each_steps_collectives(engine: Engine, smol_tp2: Engine) -> None:
    """`halfmoon bench engine --tp`'s measurement: per step, 2 all_reduces a layer + the
    embedding's + the logits' gather, and time in them only where there is a group."""
    from halfmoon.bench.tp_bench import Sizes, measure

    results = measure({1: engine, 2: smol_tp2}, Sizes(prompt=16, batches=(2,), steps=2), repeats=1)
    layers = smol_tp2.model_config.num_layers
    for work in ("prefill", "decode_b2"):
        one, two = results[work][1], results[work][2]
        assert one.collectives == 0 and one.collective_ms == 0 and one.step_ms > 0
        assert two.collectives == 2 * layers + 2 and 0 < two.collective_ms < two.step_ms
    assert_engine_idle(engine)
    assert_engine_idle(smol_tp2)


def test_the_kv_handshake_moves_kv_between_layouts_and_block_pulls_refuse_them(folders: dict[str, Path]) -> None:
    """Qwen3's one KV head is replicated: rank 0 of TP=2 holds the same bytes per block as
    TP=1. A KV push between the layouts is accepted (the pair moves head 0, transport/heads.py);
    a block pull (exact) names the field that differs instead of reading another layout's block."""
    from halfmoon.transport.errors import HandshakeError
    from halfmoon.transport.protocol import check_hello, hello

    one, two = tp_engine(str(folders["qwen3"])), tp_engine(str(folders["qwen3"]), tp=2)
    try:
        a, b = one.kv_layout(), two.kv_layout()
        assert (a.num_kv_heads, a.tp, b.num_kv_heads, b.tp, b.kv_head_start, b.total_kv_heads) == (1, 1, 1, 2, 0, 1)
        nonce = b"n" * 16
        assert check_hello(hello(b, nonce, None), a, nonce, None, exact=False) == b
        with pytest.raises(HandshakeError) as err:
            check_hello(hello(b, nonce, None), a, nonce, None)
        assert err.value.field == "tp"
    finally:
        one.close()
        two.close()


def test_the_transport_shards_kv_heads_as_the_engine_does() -> None:
    from halfmoon.transport.heads import kv_head_range

    for kv, group, tp in itertools.product((1, 2, 3, 4, 8), (1, 2, 4, 8), (1, 2, 3, 4, 8)):
        if kv < tp and (tp % kv or group % (tp // kv)):
            continue
        for rank in range(tp):
            s = plan_shard(_cfg(kv * group, kv, intermediate=256, vocab=64), rank, tp).kv_heads
            assert (s.start, s.stop) == kv_head_range(kv, rank, tp)


def test_tp_engines_hash_blocks_under_their_own_root() -> None:
    """A prefix cached under one layout is never a hit for another (docs/ARCHITECTURE.md)."""
    assert EngineConfig().kv_tag == "float32" and EngineConfig(tp=2, host_cache_gb=0).kv_tag == "float32+tp2"
    assert EngineConfig(tp=2, quantization="int4").kv_tag == "float32+int4+tp2"


def test_verification_step_packets_carry_the_rows_per_request(engine: Engine) -> None:
    """A speculative verification beside a prefill chunk: each decode's rows (q_lens) cross to
    the other ranks (they once did not: a rank read every decode as one row, failing a mixed
    step and mis-attending a verification-only one)."""
    def request(n: int, computed: int, blocks: list[int]) -> Request:
        req = Request(f"r{n}", list(range(3, 3 + n)), SamplingParams(), n, torch.Generator())
        req.block_table, req.num_computed_tokens = blocks, computed
        return req

    scheduled = [ScheduledRequest(request(20, 19, [4, 7]), 4, True, (5, 6, 7)),
                 ScheduledRequest(request(5, 4, [9]), 1, True), ScheduledRequest(request(40, 16, [1, 2, 3]), 24, True)]
    sent = engine.runner.prepare(scheduled)
    got = decode_step(encode_step(sent))
    assert got is not None and sent.meta.decode is not None and got.meta.decode is not None
    assert sent.meta.decode.q_lens is not None and torch.equal(got.meta.decode.q_lens, sent.meta.decode.q_lens)
    assert got.meta.decode.num_rows == sent.meta.decode.num_rows == 5
    (p,), (q,) = got.meta.prefills, sent.meta.prefills
    assert (p.q_start, p.q_len, p.ctx_len) == (q.q_start, q.q_len, q.ctx_len) == (5, 24, 40)


def test_speculation_on_a_tp_engine_is_token_identical(folders: dict[str, Path]) -> None:
    """n-gram drafts verified across two ranks (a windowed family), prompts that repeat so the
    drafts are accepted, beside chunked prefills: the same greedy tokens as TP=1 without drafts."""
    repetitive = [[5 + (i % 7) for i in range(40)], [9 + (i % 5) for i in range(33)], list(range(3, 60))]
    one = tp_engine(str(folders["gemma3"]))
    two = tp_engine(str(folders["gemma3"]), tp=2, speculative="ngram", speculative_max_batch=8)
    try:
        want = greedy(one, repetitive, NEW)
        assert greedy(two, repetitive, NEW) == want
        assert two.speculator is not None and two.speculator.stats.accepted > 0  # drafts were verified
    finally:
        one.close()
        two.close()
