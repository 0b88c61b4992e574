"""Decode and speculative verification CUDA graphs (engine/cuda_graphs.py): bucket choice,
padding, the persistent buffers, token-identical output.

On CPU the graph object is replaced by `ReplayByCallFake` (a fake, named as such): its
`replay()` calls the captured function again and copies the result into the output tensor it
returned at capture, so the bucket, padding and persistent-buffer protocol run for real with
the real model over the real paged KV cache; only the recording is not a CUDA graph. The real
torch.cuda.CUDAGraph path runs in `test_cuda_graphs_match_eager_on_cuda` and
`test_cuda_verification_graphs_match_eager_on_cuda`, skipped here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from halfmoon.core.errors import ConfigError
from halfmoon.core.params import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.cuda_graphs import (Bucket, DecodeGraphs, VerifyBucket, VerifyGraphs, VerifyShape, batch_buckets,
                                ctx_buckets, graph_ctx_limit, pick, query_buckets)
from halfmoon.engine.device import build_graphs, build_step_graphs, graphs_wanted
from halfmoon.engine.engine import Engine
from halfmoon.kernels.attention import DecodeBatch
from halfmoon.kernels.torch_backend import TorchAttentionBackend
from tests.conftest import NUM_THREADS
from tests.model_families import BY_NAME, build_checkpoint, prompts

NEW = 12
SPEC_NEW = 40  # long enough for the random-weight model's output to repeat (n-gram drafts)


class ReplayByCallFake:
    """FAKE graph: replay = call the step function again, into the output kept at capture."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn
        self.output = fn()
        self.replays = 0

    def replay(self) -> None:
        with torch.inference_mode():  # the output is the model's (an inference tensor)
            self.output.copy_(self.fn())
        self.replays += 1


class FakeCapture:
    """FAKE recorder: every capture becomes a ReplayByCallFake, kept by bucket order."""

    def __init__(self) -> None:
        self.captured: list[ReplayByCallFake] = []

    def capture(self, fn: Callable[[], torch.Tensor]) -> ReplayByCallFake:
        graph = ReplayByCallFake(fn)
        self.captured.append(graph)
        return graph


def test_batch_buckets_are_vllms_list_up_to_the_max() -> None:
    assert batch_buckets(1) == (1,)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(30) == (1, 2, 4, 8, 16, 24, 30)
    with pytest.raises(ValueError):
        batch_buckets(0)


def test_ctx_buckets_double_from_256_to_the_limit() -> None:
    assert ctx_buckets(2048, 16) == (256, 512, 1024, 2048)
    assert ctx_buckets(1040, 16) == (256, 512, 1024, 1040)
    assert ctx_buckets(64, 16) == (64,)
    assert ctx_buckets(384, 48) == (288, 384)  # 256 rounded up to whole blocks first
    with pytest.raises(ValueError):
        ctx_buckets(100, 16)


def test_pick_is_the_smallest_bucket_that_fits() -> None:
    sizes = batch_buckets(32)
    assert [pick(sizes, n) for n in (1, 2, 3, 5, 8, 9, 17, 32, 33)] == [1, 2, 4, 8, 8, 16, 24, 32, None]


def test_graph_context_limit_stops_at_the_smallest_window() -> None:
    assert graph_ctx_limit(1000, [0, 0], 16) == 1008  # the context limit, rounded up to a block
    assert graph_ctx_limit(1000, [0, 100, 4096], 16) == 96  # the smallest window, rounded down
    assert graph_ctx_limit(1000, [10, 0], 16) == 0  # a window under one block: no graphs


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("graphs") / "llama"
    build_checkpoint(BY_NAME["llama"], path)
    return path


def engine_on_cpu(folder: Path, **overrides: object) -> Engine:
    return Engine(EngineConfig(**{"model": str(folder), "num_blocks": 64, "num_threads": NUM_THREADS,
                                  "max_num_batched_tokens": 64, "max_num_seqs": 6, **overrides}))


def with_fake_graphs(engine: Engine) -> tuple[DecodeGraphs, FakeCapture, int]:
    """Fake-captured graphs on a CPU engine; the pad block is a block taken from its pool."""
    (pad,) = engine.pool.allocate(1)
    capture = FakeCapture()
    graphs = build_graphs(engine.config, engine.model.forward, engine.kv_cache, pad, engine.max_model_len,
                          engine.windows, capture)
    assert graphs is not None
    engine.runner.graphs = graphs
    return graphs, capture, pad


def greedy(engine: Engine, prompt_ids: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    return [r.output_ids for r in engine.generate(prompt_ids, params)]


def test_every_bucket_is_captured_once(folder: Path) -> None:
    engine = engine_on_cpu(folder)
    graphs, capture, _ = with_fake_graphs(engine)
    assert graphs.rows == (1, 2, 4, 6)
    assert graphs.ctxs == (256,)  # the tiny model's 256-token context
    assert set(graphs.graphs) == {Bucket(b, 256) for b in (1, 2, 4, 6)}
    assert len(capture.captured) == 4
    assert graphs.logits is not None and graphs.logits.shape[0] == 6
    assert {g.output.data_ptr() for g in graphs.graphs.values()} == {graphs.logits.data_ptr()}, \
        "every decode graph's logits land in one shared buffer (no output per graph in the pool)"


def test_replayed_decode_steps_are_token_identical_to_eager(folder: Path) -> None:
    ps = prompts(3)  # 3 requests: the 4-row bucket with one padding row
    eager = greedy(engine_on_cpu(folder), ps)
    engine = engine_on_cpu(folder)
    kv_before = engine.kv_cache.clone()
    graphs, capture, pad = with_fake_graphs(engine)
    changed = (engine.kv_cache != kv_before).flatten(3).any(-1).any(1).any(0).nonzero().flatten().tolist()
    assert changed == [pad], "capturing (all rows padding) writes the pad block only"
    assert greedy(engine, ps) == eager
    assert graphs.replays >= NEW - 1  # every all-decode step of the batch replayed a graph
    assert sum(g.replays for g in capture.captured) == graphs.replays
    engine.pool.free([pad])
    engine.pool.check_integrity()


def test_a_batch_wider_than_the_largest_bucket_runs_eagerly(folder: Path) -> None:
    engine = engine_on_cpu(folder)
    graphs, _, _ = with_fake_graphs(engine)
    graphs.rows = (1, 2)  # pretend the largest bucket holds 2 rows
    ps = prompts(3)
    assert greedy(engine, ps) == greedy(engine_on_cpu(folder), ps)
    assert graphs.eager > 0  # the 3-row decode steps (steps of 1-2 decoding rows still replay)


def test_load_pads_rows_and_keeps_persistent_buffers(folder: Path) -> None:
    engine = engine_on_cpu(folder)
    graphs, _, pad = with_fake_graphs(engine)
    before = {name: getattr(graphs, name).data_ptr() for name in ("ids", "positions", "slots", "tables", "ctx_lens")}
    ids, positions = torch.tensor([5, 6, 7]), torch.tensor([40, 3, 17])
    slots = torch.tensor([100, 200, 300])
    dec = DecodeBatch(3, torch.tensor([[1, 2, 3], [4, 0, 0], [5, 6, 0]]), torch.tensor([41, 4, 18]), 41, None)
    graphs.load(ids, positions, slots, dec, Bucket(4, 256))
    assert graphs.ids[:4].tolist() == [5, 6, 7, 0]
    assert graphs.positions[:4].tolist() == [40, 3, 17, 0]
    assert graphs.slots[:4].tolist() == [100, 200, 300, pad * engine.config.block_size]
    assert graphs.ctx_lens[:4].tolist() == [41, 4, 18, 1]
    assert graphs.tables[0, :3].tolist() == [1, 2, 3]
    assert set(graphs.tables[3].tolist()) == {pad}
    after = {name: getattr(graphs, name).data_ptr() for name in before}
    assert after == before, "a step copies into the captured buffers, never replaces them"


def test_a_layer_hook_step_runs_eagerly(folder: Path) -> None:
    engine = engine_on_cpu(folder)
    graphs, _, _ = with_fake_graphs(engine)
    calls: list[int] = []
    engine.runner.layer_hook = calls.append
    engine.pushes.hook = lambda scheduled: engine.runner.layer_hook  # keep the hook every step
    greedy(engine, prompts(1))
    assert graphs.replays == 0 and calls, "a hooked step must run the layers eagerly"


def test_graphs_are_off_on_cpu_by_flag_and_with_flashinfer(folder: Path) -> None:
    assert engine_on_cpu(folder).runner.graphs is None  # device cpu: nothing captured
    kv = torch.empty(1, 2, 4, 16, 1, 1)
    for off in (EngineConfig(model=str(folder), device="cuda", cuda_graphs=False),
                EngineConfig(model=str(folder), device="cuda", attention_backend="flashinfer")):
        assert not graphs_wanted(off)
        assert build_graphs(off, lambda *a: torch.empty(0), kv, 3, 256, []) is None
    assert graphs_wanted(EngineConfig(model=str(folder), device="cuda"))


# ------------------------------------------------------------- speculative verification graphs


def test_query_buckets_double_the_draft_up_to_the_max() -> None:
    assert query_buckets(1) == (2,)
    assert query_buckets(4) == (2, 3, 5)
    assert query_buckets(6) == (2, 3, 5, 7)
    assert query_buckets(16) == (2, 3, 5, 9, 17)
    with pytest.raises(ValueError):
        query_buckets(0)


def bare_verify_graphs(pad: int = 19) -> VerifyGraphs:
    """Verification graphs over a small KV tensor (block size 16), nothing captured."""
    kv = torch.zeros(1, 2, pad + 1, 16, 1, 1)
    return VerifyGraphs(lambda *a: torch.empty(0), kv, pad, 6, 6, 512, FakeCapture())


def test_a_verification_picks_the_smallest_bucket_that_holds_it() -> None:
    graphs = bare_verify_graphs()
    assert (graphs.requests, graphs.queries, graphs.ctxs) == ((1, 2, 4, 6), (2, 3, 5, 7), (256, 512))
    # 3 requests, at most 4 rows: 5 rows each; the context bucket covers cached keys + 5
    assert graphs.bucket_for(VerifyShape([3, 1, 4], [40, 41, 255])) == VerifyBucket(4, 5, 256)
    # 256 keys fit a 256-key decode graph, but 252 cached + 5 rows do not
    assert graphs.bucket_for(VerifyShape([3, 1, 4], [40, 41, 256])) == VerifyBucket(4, 5, 512)
    assert graphs.bucket_for(VerifyShape([2], [10])) == VerifyBucket(1, 2, 256)
    assert graphs.bucket_for(VerifyShape([2] * 7, [10] * 7)) is None  # more requests than any bucket
    assert graphs.bucket_for(VerifyShape([8], [10])) is None  # more rows than any bucket
    assert graphs.bucket_for(VerifyShape([7], [512])) == VerifyBucket(1, 7, 512)
    assert graphs.bucket_for(VerifyShape([6], [512])) is None  # 506 cached + 7 rows: past 512


def test_verification_load_pads_rows_and_requests_into_the_pad_block() -> None:
    """Request b's row j goes to row b * queries + j; the rest is padding writing the pad block;
    a request's context counts `queries` rows so its real rows see the keys they would."""
    graphs = bare_verify_graphs(pad=19)
    before = {n: getattr(graphs, n).data_ptr() for n in ("ids", "positions", "slots", "tables", "ctx_lens")}
    shape = VerifyShape([2, 1, 3], [10, 5, 20])
    ids, positions = torch.tensor([11, 12, 21, 31, 32, 33]), torch.tensor([8, 9, 4, 17, 18, 19])
    slots = torch.tensor([40, 41, 84, 113, 114, 115])
    dec = DecodeBatch(3, torch.tensor([[2, 3], [5, 0], [7, 1]]), torch.tensor(shape.ctx), 20, None,
                      q_lens=torch.tensor(shape.q_lens))
    dest = graphs.load(ids, positions, slots, dec, shape, VerifyBucket(4, 3, 256))
    pad_slot = 19 * 16
    assert dest.tolist() == [0, 1, 3, 6, 7, 8]
    assert graphs.ids[:12].tolist() == [11, 12, 0, 21, 0, 0, 31, 32, 33, 0, 0, 0]
    assert graphs.positions[:12].tolist() == [8, 9, 0, 4, 0, 0, 17, 18, 19, 0, 0, 0]
    assert graphs.slots[:12].tolist() == [40, 41, pad_slot, 84, pad_slot, pad_slot, 113, 114, 115,
                                          pad_slot, pad_slot, pad_slot]
    assert graphs.ctx_lens[:4].tolist() == [11, 7, 20, 3]  # ctx - q_len + 3; padding: 3 pad keys
    assert graphs.tables[:3, :2].tolist() == [[2, 3], [5, 0], [7, 1]]
    assert set(graphs.tables[3].tolist()) == {19}
    assert {n: getattr(graphs, n).data_ptr() for n in before} == before


def with_fake_step_graphs(engine: Engine) -> tuple[DecodeGraphs, VerifyGraphs, int]:
    """Fake-captured decode and verification graphs on a CPU engine (the pad block from its pool)."""
    (pad,) = engine.pool.allocate(1)
    decode, verify = build_step_graphs(engine.config, engine.model.forward, engine.kv_cache, pad,
                                       engine.max_model_len, engine.windows, FakeCapture())
    assert decode is not None and verify is not None
    engine.runner.graphs, engine.runner.verify_graphs = decode, verify
    return decode, verify, pad


def quoting_prompts() -> list[list[int]]:
    return [p[:20] * 2 for p in prompts(3)]  # repeated text: prompt lookup finds drafts


def greedy_long(engine: Engine, prompt_ids: list[list[int]]) -> list[list[int]]:
    out = [r.output_ids for r in engine.generate(prompt_ids, SamplingParams(max_tokens=SPEC_NEW, ignore_eos=True))]
    engine.pool.check_integrity()
    return out


@pytest.fixture(scope="module")
def plain_and_eager_spec(folder: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy output without speculation, and with eager n-gram speculation (fp32)."""
    ps = quoting_prompts()
    return greedy_long(engine_on_cpu(folder), ps), greedy_long(engine_on_cpu(folder, speculative="ngram"), ps)


def test_every_verification_bucket_is_captured_writing_only_the_pad_block(folder: Path) -> None:
    engine = engine_on_cpu(folder, speculative="ngram")
    kv_before = engine.kv_cache.clone()
    decode, verify, pad = with_fake_step_graphs(engine)
    assert set(verify.graphs) == {VerifyBucket(r, q, 256) for r in (1, 2, 4, 6) for q in (2, 3, 5, 7)}
    assert len(decode.graphs) == 4
    assert verify.logits is not None and verify.logits.shape[0] == 6 * 7
    assert {g.output.data_ptr() for g in verify.graphs.values()} == {verify.logits.data_ptr()}, \
        "every verification graph's logits land in one shared buffer"
    changed = (engine.kv_cache != kv_before).flatten(3).any(-1).any(1).any(0).nonzero().flatten().tolist()
    assert changed == [pad]


def test_replayed_verifications_are_token_identical_to_eager_and_to_plain_greedy(
        folder: Path, plain_and_eager_spec: tuple[list[list[int]], list[list[int]]]) -> None:
    plain, eager = plain_and_eager_spec
    assert eager == plain
    engine = engine_on_cpu(folder, speculative="ngram")
    decode, verify, _ = with_fake_step_graphs(engine)
    assert greedy_long(engine, quoting_prompts()) == plain
    stats = engine.speculator.stats
    assert verify.replays >= 5 and stats.accepted > 0  # it verified (and accepted) through graphs
    assert verify.eager == 0 and decode.replays > 0


@pytest.mark.parametrize("path", ["widest bucket", "gather path"])
def test_padded_verifications_are_token_identical(folder: Path, path: str,
                                                  plain_and_eager_spec: tuple[list[list[int]], list[list[int]]]) -> None:
    """Every verification padded to 6 requests x 7 rows (padding queries inside real requests);
    or the torch gather path with the static rows (the path CUDA runs) instead of the native kernels."""
    engine = engine_on_cpu(folder, speculative="ngram")
    _, verify, _ = with_fake_step_graphs(engine)
    if path == "widest bucket":
        verify.requests, verify.queries = (6,), (7,)
    else:
        engine.model.backend = TorchAttentionBackend(native_decode=False)
        engine.model.fused_decode = False
    assert greedy_long(engine, quoting_prompts()) == plain_and_eager_spec[0]
    assert verify.replays >= 5


def test_a_verification_wider_than_the_buckets_runs_eagerly(
        folder: Path, plain_and_eager_spec: tuple[list[list[int]], list[list[int]]]) -> None:
    engine = engine_on_cpu(folder, speculative="ngram")
    _, verify, _ = with_fake_step_graphs(engine)
    verify.requests = (1, 2)  # pretend the largest bucket holds 2 requests
    assert greedy_long(engine, quoting_prompts()) == plain_and_eager_spec[0]
    assert verify.eager > 0


def test_verification_graphs_follow_speculation_and_the_graph_flag(folder: Path) -> None:
    kv = torch.zeros(1, 2, 4, 16, 1, 1)

    def forward(*args: object) -> torch.Tensor:
        return torch.zeros(1)

    for off in (EngineConfig(model=str(folder), device="cuda", cuda_graphs=False, speculative="ngram"),
                EngineConfig(model=str(folder), speculative="ngram")):  # the flag; CPU
        assert build_step_graphs(off, forward, kv, 3, 256, []) == (None, None)
    no_spec = EngineConfig(model=str(folder), max_num_seqs=4)
    capture = FakeCapture()
    decode, verify = build_step_graphs(no_spec, forward, kv, 3, 256, [], capture)
    assert decode is not None and verify is None
    assert engine_on_cpu(folder, speculative="ngram").runner.verify_graphs is None  # CPU: none


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures real CUDA graphs; this machine has no CUDA device")
def test_cuda_graphs_match_eager_on_cuda(folder: Path) -> None:
    ps = prompts(3)
    eager = engine_on_cpu(folder, device="cuda", cuda_graphs=False)
    graphed = engine_on_cpu(folder, device="cuda")
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    assert greedy(graphed, ps) == greedy(eager, ps)
    assert graphed.runner.graphs.replays >= NEW - 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="speculates on CUDA; this machine has no CUDA device")
def test_cuda_speculative_matches_plain_greedy(folder: Path) -> None:
    """ngram speculation on CUDA (verification and plain decode steps replayed from graphs)."""
    ps = quoting_prompts()
    plain = greedy(engine_on_cpu(folder, device="cuda"), ps)
    spec = engine_on_cpu(folder, device="cuda", speculative="ngram")
    assert greedy(spec, ps) == plain
    assert spec.speculator is not None and spec.speculator.stats.proposed > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures real CUDA graphs; this machine has no CUDA device")
def test_cuda_verification_graphs_match_eager_on_cuda(folder: Path) -> None:
    """Real CUDA verification graphs: token-identical to eager speculation and plain greedy."""
    ps = quoting_prompts()
    plain = greedy_long(engine_on_cpu(folder, device="cuda", cuda_graphs=False), ps)
    eager = engine_on_cpu(folder, device="cuda", cuda_graphs=False, speculative="ngram")
    graphed = engine_on_cpu(folder, device="cuda", speculative="ngram")
    verify = graphed.runner.verify_graphs
    assert verify is not None and eager.runner.verify_graphs is None
    assert greedy_long(eager, ps) == plain
    assert greedy_long(graphed, ps) == plain
    assert verify.replays >= 5 and graphed.speculator is not None and graphed.speculator.stats.accepted > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where there is no CUDA device")
def test_device_cuda_without_a_gpu_is_a_clear_error(folder: Path) -> None:
    with pytest.raises(ConfigError, match="no CUDA device"):
        engine_on_cpu(folder, device="cuda")


def test_device_config_is_validated() -> None:
    for bad in ({"device": "tpu"}, {"gpu_memory_fraction": 1.5},
                {"device": "cuda", "quantization": "int8"}, {"device": "cuda", "tp": 2}):
        with pytest.raises(ConfigError):
            EngineConfig(**bad)
