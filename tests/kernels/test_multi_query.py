"""Several query rows per decoding request (`DecodeBatch.q_lens`: speculative decoding's verify
step) in every attention path: the native kernel (`_paged_attn.decode` / `decode_rope` with
q_starts), the torch gather path, the flashinfer translation (stand-in module), the fused step.

Request i's rows are [q_starts[i], q_starts[i + 1]); with n rows and ctx keys its row j sees the
keys at positions < ctx - n + j + 1, under a window W only the last W of them.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from halfmoon.engine.model import apply_rope, rope_tables
from halfmoon.kernels import _paged_attn, fused
from halfmoon.kernels.attention import AttentionMetadata, DecodeBatch
from halfmoon.kernels.flashinfer_backend import FlashInferAttentionBackend, step_tables
from halfmoon.kernels.torch_backend import TorchAttentionBackend, decode_rows_keys, query_rows
from tests.kernels.paged_scene import Scene, make_scene, run_backend
from tests.kernels.fake_flashinfer import fake_flashinfer

BACKENDS = {"native": lambda: TorchAttentionBackend(),
            "gather": lambda: TorchAttentionBackend(native_decode=False)}
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
# contexts and rows: one-row requests among them, rows across block boundaries (block size 4, 5
# and 16: 16 keys with 2 rows, 17 with 3), a request whose every key is new (5 of 5)
CTX = [1, 5, 16, 17, 40, 100, 33, 50]
ROWS = [1, 5, 2, 3, 1, 4, 5, 2]


def reference(scene: Scene, cache: torch.Tensor, window: int = 0,
              scale: float | None = None) -> torch.Tensor:
    """Per query row: softmax over the keys it sees, in float64, with no paging tricks."""
    heads, head_dim = scene.q.shape[1:]
    block_size, kv_heads = cache.shape[2], cache.shape[-2]
    flat = cache.view(2, -1, kv_heads, head_dim).double()
    meta, dec = scene.meta, scene.meta.decode
    spans = []
    if dec is not None:
        starts = dec.q_starts.tolist() if dec.q_starts is not None else list(range(dec.num + 1))
        spans += [(starts[i], starts[i + 1] - starts[i], dec.block_tables[i],
                   int(dec.ctx_lens[i])) for i in range(dec.num)]
    spans += [(s.q_start, s.q_len, s.block_table, s.ctx_len) for s in meta.prefills]
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.full((meta.num_tokens, heads, head_dim), float("nan"), dtype=torch.float64)
    for q_start, q_len, table, ctx in spans:
        slots = (table.unsqueeze(1) * block_size + torch.arange(block_size)).flatten()[:ctx]
        k = flat[0][slots].repeat_interleave(heads // kv_heads, dim=1)  # [ctx, heads, d]
        v = flat[1][slots].repeat_interleave(heads // kv_heads, dim=1)
        for j in range(q_len):
            hi = ctx - q_len + j + 1
            lo = max(0, hi - window) if window else 0
            scores = torch.einsum("hd,khd->hk", scene.q[q_start + j].double(), k[lo:hi])
            out[q_start + j] = torch.einsum("hk,khd->hd", (scores * scale).softmax(-1), v[lo:hi])
    return out.flatten(1)


def _attend(backend: TorchAttentionBackend, scene: Scene, window: int = 0,
            scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    cache = scene.cache.clone()
    out = torch.full((scene.meta.num_tokens, scene.q.shape[1] * scene.q.shape[2]), float("nan"),
                     dtype=scene.q.dtype)
    backend.write_kv(cache, scene.k, scene.v, scene.meta.slot_mapping)
    backend.forward(scene.q, cache, scene.meta, out, window=window, scale=scale)
    return out, cache


def test_decode_batch_rows() -> None:
    dec = make_scene(decode_ctx=CTX, prefills=[], decode_q=ROWS).meta.decode
    assert dec is not None and dec.multi_query
    assert dec.q_starts.tolist() == [0, 1, 6, 8, 11, 12, 16, 21, 23]
    assert dec.num_rows == 23
    one = make_scene(decode_ctx=CTX, prefills=[]).meta.decode
    assert one is not None and not one.multi_query and one.num_rows == 8 and one.q_starts is None
    with pytest.raises(ValueError, match="q_starts without q_lens"):
        DecodeBatch(1, one.block_tables[:1], one.ctx_lens[:1], 1, None, None, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"q_lens is \[2\]"):
        DecodeBatch(2, one.block_tables[:2], one.ctx_lens[:2], 5, None, torch.tensor([1]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (4, 2, 64, 16), (8, 1, 256, 16), (6, 3, 64, 5), (32, 2, 64, 4)])
@pytest.mark.parametrize("window", [0, 1, 3, 7, 50])
def test_decode_rows_match_reference(backend: str, dtype: torch.dtype, heads: int,
                                     kv_heads: int, head_dim: int, block_size: int,
                                     window: int) -> None:
    """GQA groups 2, 8, 2 and 16 (16 x 5 rows: the native kernel's two passes over the keys),
    windows narrower than a request's rows (1, 3), inside a block, over several blocks, wider
    than most contexts."""
    scene = make_scene(decode_ctx=CTX, prefills=[], decode_q=ROWS, heads=heads,
                       kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
                       seed=window + head_dim)
    got, cache = _attend(BACKENDS[backend](), scene, window, scale=0.07)
    want = reference(scene, cache, window, scale=0.07)
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 6])
def test_mixed_step_every_path_matches_reference(dtype: torch.dtype, window: int) -> None:
    """Multi-query decode rows, then prefill chunks (one from position 0, two after a cached
    prefix): native, gather and the flashinfer translation (decode rows through BatchPrefill)."""
    scene = make_scene(decode_ctx=[9, 1, 13, 30], decode_q=[3, 1, 5, 2],
                       prefills=[(0, 7), (5, 6), (20, 1)], head_dim=64, dtype=dtype, seed=11)
    want = None
    for make in (*BACKENDS.values(), lambda: FlashInferAttentionBackend(module=fake_flashinfer())):
        got, cache = _attend(make(), scene, window)
        if want is None:
            want = reference(scene, cache, window)
        torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,block_size", [(0, 16), (0, 64), (7, 16), (20, 5)])
def test_native_row_is_bit_identical_to_the_same_query_alone(dtype: torch.dtype, window: int,
                                                             block_size: int) -> None:
    """Row j of a request equals the one-row decode of the same query over the first
    ctx - n + j + 1 keys, bit for bit (the same chunks, scores and sums: no window, or blocks no
    wider than the kernel's 32-token chunks): a verify step's attention is what decoding the
    tokens one by one computes."""
    ctx, rows = [37, 70, 5, 18], [5, 2, 5, 4]
    scene = make_scene(decode_ctx=ctx, prefills=[], decode_q=rows, heads=8, kv_heads=2,
                       head_dim=64, block_size=block_size, dtype=dtype, seed=3)
    got, cache = _attend(TorchAttentionBackend(), scene, window)
    dec = scene.meta.decode
    assert dec is not None
    # every row as a one-row request of its own: same block table, ctx = its last visible key
    owner = torch.repeat_interleave(torch.arange(len(ctx)), dec.q_lens)
    row_ctx = torch.cat([torch.arange(c - n + 1, c + 1) for c, n in zip(ctx, rows)])
    alone = DecodeBatch(len(owner), dec.block_tables[owner].contiguous(), row_ctx,
                        int(row_ctx.max()), None)
    meta = AttentionMetadata(scene.meta.slot_mapping, alone, [], len(owner))
    want = torch.full_like(got, float("nan"))
    TorchAttentionBackend().forward(scene.q, cache, meta, want, window=window)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 5])
def test_one_row_each_through_q_lens_is_todays_result(dtype: torch.dtype, window: int) -> None:
    """q_lens of ones: the native kernel bit-identical to q_lens=None; the gather path's
    multi-query layout within rounding of its one-row path."""
    base = make_scene(decode_ctx=CTX, prefills=[(3, 4)], head_dim=64, dtype=dtype, seed=5)
    ones = make_scene(decode_ctx=CTX, prefills=[(3, 4)], head_dim=64, dtype=dtype, seed=5,
                      decode_q=[1] * len(CTX))
    assert ones.meta.decode is not None and ones.meta.decode.multi_query
    for name, make in BACKENDS.items():
        want, _ = _attend(make(), base, window)
        got, _ = _attend(make(), ones, window)
        if name == "native":
            assert torch.equal(got[: len(CTX)], want[: len(CTX)])
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_native_kernel_takes_any_number_of_rows() -> None:
    """More rows than one pass holds (group 8: 8 rows a pass): 20 rows, 3 passes."""
    scene = make_scene(decode_ctx=[60, 21, 9], decode_q=[20, 21, 1], prefills=[], heads=16,
                       kv_heads=2, head_dim=64, block_size=8, seed=2)
    got, cache = _attend(TorchAttentionBackend(), scene, 9)
    torch.testing.assert_close(got.double(), reference(scene, cache, 9), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_starts,match", [
    ([0, 1, 1], "request 1 has 0 query rows"),
    ([0, 3, 4], "request 0 has 3 query rows and 2 keys"),
    ([1, 2, 3], r"q_starts\[0\] is 0"),
])
def test_native_kernel_refuses_rows_it_cannot_attend(q_starts: list[int], match: str) -> None:
    scene = make_scene(decode_ctx=[2, 6], prefills=[])
    dec = scene.meta.decode
    assert dec is not None
    starts = torch.tensor(q_starts)
    out = torch.empty(4, 4 * 16)
    with pytest.raises(ValueError, match=match):
        _paged_attn.decode(scene.q.data_ptr(), scene.q.stride(0), scene.cache.data_ptr(),
                           dec.block_tables.data_ptr(), dec.block_tables.stride(0),
                           dec.ctx_lens.data_ptr(), out.data_ptr(), out.stride(0), 2, 4, 2, 16,
                           scene.cache.shape[1], 4, False, 0.25, 1, 0, starts.data_ptr())


def test_gather_masks_and_padding_are_built_once_per_step() -> None:
    """One padding layout per step; one mask per (window, group); every layer reuses them."""
    scene = make_scene(decode_ctx=[9, 4], decode_q=[3, 1], prefills=[], seed=1)
    backend = TorchAttentionBackend(native_decode=False)
    for window in (0, 3, 0, 3):
        _attend(backend, scene, window)
    assert set(scene.meta.window_cache) == {
        ("torch.decode_rows",), ("torch.decode_rows", 0, 2), ("torch.decode_rows", 3, 2)}
    dec = scene.meta.decode
    assert dec is not None
    layout = query_rows(dec)
    assert layout.q_max == 3
    assert layout.pad.tolist() == [0, 1, 2, 3, 3, 3]  # request 1's one row repeated
    assert layout.keep.tolist() == [0, 1, 2, 3]
    # request 0: 9 keys, 6, 7, 8 new, window 3: its rows see 4..6, 5..7, 6..8; its columns start
    # at block 1 (key 4). Request 1: 4 keys, its row sees 1..3; its columns start at key 0.
    keys = decode_rows_keys(dec, 3, 4, group=1)
    assert keys.tables[0].tolist() == dec.block_tables[0, 1:3].tolist()
    assert keys.mask.shape == (2, 1, 3, 8)
    assert keys.mask[0, 0].int().tolist() == [[1, 1, 1, 0, 0, 0, 0, 0],
                                              [0, 1, 1, 1, 0, 0, 0, 0],
                                              [0, 0, 1, 1, 1, 0, 0, 0]]
    assert keys.mask[1, 0, 0].int().tolist() == [0, 1, 1, 1, 0, 0, 0, 0]
    grouped = decode_rows_keys(dec, 3, 4, group=2).mask  # each row once per query head
    assert torch.equal(grouped, keys.mask.repeat_interleave(2, dim=2))


# ---------------------------------------------------------------- fused step: decode_rope


def tables(head_dim: int, dtype: torch.dtype, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = SimpleNamespace(rope_theta=theta, head_dim=head_dim, max_position=128)
    return rope_tables(cfg, dtype)  # type: ignore[arg-type]


def _torch_attend(scene: Scene, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                  rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor, window: int,
                  scale: float | None, q_norm: torch.Tensor | None = None,
                  k_norm: torch.Tensor | None = None,
                  eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Norms,) RoPE, write_kv of every row, then the native decode: engine/model.py's `_layer`."""
    t = qkv.shape[0]
    rows = qkv.view(t, heads + 2 * kv_heads, head_dim)
    q, k = rows[:, :heads], rows[:, heads : heads + kv_heads]
    if q_norm is not None:
        q = F.rms_norm(q, (head_dim,), q_norm, eps)
    if k_norm is not None:
        k = F.rms_norm(k, (head_dim,), k_norm, eps)
    c, s = rope[0][positions].unsqueeze(1), rope[1][positions].unsqueeze(1)
    q, k = apply_rope(q, c, s), apply_rope(k, c, s)
    cache = scene.cache.clone()
    out = torch.full((t, heads * head_dim), float("nan"), dtype=qkv.dtype)
    backend = TorchAttentionBackend()
    backend.write_kv(cache, k, rows[:, heads + kv_heads :], scene.meta.slot_mapping)
    backend.forward(q, cache, scene.meta, out, window=window, scale=scale)
    return q, cache, out


def _rows_scene(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                seed: int) -> tuple[Scene, torch.Tensor, torch.Tensor]:
    """A verify step: rows per request 1..5; returns the scene, qkv rows, positions per row."""
    scene = make_scene(decode_ctx=CTX, prefills=[], decode_q=ROWS, heads=heads,
                       kv_heads=kv_heads, head_dim=head_dim, block_size=16, dtype=dtype,
                       seed=seed)
    positions = torch.cat([torch.arange(c - n, c) for c, n in zip(CTX, ROWS)])
    qkv = (torch.cat([scene.q, scene.k, scene.v], dim=1).flatten(1) * 3).to(dtype)
    return scene, qkv, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (9, 3, 64), (8, 2, 256)])
@pytest.mark.parametrize("window", [0, 3, 20])
def test_decode_rope_rows_equal_rope_write_kv_then_attention(
        dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, window: int) -> None:
    """Every row's q rotated in place, every row's K and V in its slot before any row of the
    request attends, and the output: bit-identical to apply_rope + write_kv + native decode."""
    scene, qkv, positions = _rows_scene(dtype, heads, kv_heads, head_dim, seed=head_dim + window)
    local = tables(head_dim, dtype, theta=10.0)
    want_q, want_cache, want_out = _torch_attend(scene, qkv, heads, kv_heads, head_dim, local,
                                                 positions, window, 0.125)
    cache = scene.cache.clone().unsqueeze(0)
    x = torch.zeros(len(positions), 8, dtype=dtype)
    assert fused.supported(x, cache, scene.meta, heads, tables(head_dim, dtype))
    step = fused.DecodeStep(x, positions, tables(head_dim, dtype), cache, scene.meta, heads,
                            1e-6, scale=0.125)
    got_qkv = qkv.clone()
    out = step.attend(0, got_qkv, rope=local, window=window)
    assert torch.equal(got_qkv.view(len(positions), -1, head_dim)[:, :heads], want_q)
    assert torch.equal(cache[0], want_cache)
    assert torch.equal(out, want_out)
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), reference(Scene(want_q, scene.k, scene.v, scene.cache,
                                                             scene.meta), want_cache, window,
                                                       0.125), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rope_rows_with_q_k_norm(dtype: torch.dtype) -> None:
    """Qwen3 / Gemma 3 norms on every row: within the norm's ulps of the torch composition."""
    heads, kv_heads, head_dim = 8, 2, 64
    scene, qkv, positions = _rows_scene(dtype, heads, kv_heads, head_dim, seed=4)
    g = torch.Generator().manual_seed(1)
    q_norm, k_norm = ((torch.randn(head_dim, generator=g) * 0.3 + 1).to(dtype) for _ in "qk")
    rope = tables(head_dim, dtype)
    want_q, want_cache, want_out = _torch_attend(scene, qkv, heads, kv_heads, head_dim, rope,
                                                 positions, 7, None, q_norm, k_norm)
    cache = scene.cache.clone().unsqueeze(0)
    step = fused.DecodeStep(torch.zeros(len(positions), 8, dtype=dtype), positions, rope, cache,
                            scene.meta, heads, 1e-6)
    got_qkv = qkv.clone()
    out = step.attend(0, got_qkv, window=7, q_norm=q_norm, k_norm=k_norm)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got_qkv.view(len(positions), -1, head_dim)[:, :heads], want_q,
                               atol=tol, rtol=tol)
    torch.testing.assert_close(cache[0], want_cache, atol=tol, rtol=tol)
    torch.testing.assert_close(out, want_out, atol=tol, rtol=tol)


def test_supported_counts_rows_not_requests() -> None:
    scene = make_scene(decode_ctx=[3, 5], decode_q=[2, 3], prefills=[])
    cache, rope = scene.cache.unsqueeze(0), tables(16, torch.float32)
    assert fused.supported(torch.zeros(5, 8), cache, scene.meta, 4, rope)
    dec = scene.meta.decode
    assert dec is not None
    wrong = AttentionMetadata(scene.meta.slot_mapping, dec, [], 2)  # counted in requests
    assert not fused.supported(torch.zeros(2, 8), cache, wrong, 4, rope)
    int32 = DecodeBatch(2, dec.block_tables, dec.ctx_lens, 5, None, dec.q_lens,
                        dec.q_starts.int())
    meta = AttentionMetadata(scene.meta.slot_mapping, int32, [], 5)
    assert not fused.supported(torch.zeros(5, 8), cache, meta, 4, rope)


def test_prefill_chunks_must_follow_the_decode_rows() -> None:
    """The flat layout: a verification's rows, then the prefill chunks back to back. A chunk
    placed after the decode *requests* (the runner's bug: it read a verification's queries as its
    own, and its output overwrote them) is refused, as is a gap between chunks."""
    scene = make_scene(decode_ctx=[9, 13], decode_q=[3, 4], prefills=[(0, 5), (4, 2)])
    meta, dec = scene.meta, scene.meta.decode
    assert dec is not None and [seg.q_start for seg in meta.prefills] == [7, 12]
    first, second = meta.prefills
    after_requests = dataclasses.replace(first, q_start=dec.num)
    with pytest.raises(ValueError, match="starts at row 2, not at 7"):
        AttentionMetadata(meta.slot_mapping, dec, [after_requests, second], meta.num_tokens)
    with pytest.raises(ValueError, match="starts at row 13, not at 12"):
        AttentionMetadata(meta.slot_mapping, dec, [first, dataclasses.replace(second, q_start=13)], 15)
    alone = dataclasses.replace(first, q_start=0)  # no decodes: the chunks start at row 0
    assert AttentionMetadata(meta.slot_mapping[7:12], None, [alone], 5).prefills == [alone]


# ---------------------------------------------------------------- flashinfer translation


def test_flashinfer_plans_multi_query_decode_as_prefill_rows() -> None:
    """A verify step plans no BatchDecode: the decode requests lead the BatchPrefill plan with
    qo_indptr = q_starts, the prefill chunks after them."""
    scene = make_scene(decode_ctx=[9, 1, 13], decode_q=[3, 1, 4], prefills=[(0, 5), (4, 2)],
                       seed=6)
    t = step_tables(scene.meta, 4)
    assert t.decode is None and t.prefill is not None and t.qo_indptr is not None
    assert t.qo_indptr.tolist() == [0, 3, 4, 8, 13, 15]
    assert (t.prefill_start, t.prefill_end) == (0, 15)
    assert t.prefill.last_page_len.tolist() == [1, 1, 1, 1, 2]  # ctx 9, 1, 13, 5, 6
    fi = fake_flashinfer()
    backend = FlashInferAttentionBackend(module=fi)
    for _ in range(2):
        got = run_backend(backend, scene, scene.cache.clone())
    assert fi.plan_log == ["prefill"]
    want = run_backend(TorchAttentionBackend(), scene, scene.cache.clone())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    one_row = step_tables(make_scene(decode_ctx=[9, 1], prefills=[(0, 5)]).meta, 4)
    assert one_row.decode is not None and one_row.qo_indptr.tolist() == [0, 5]
    assert (one_row.prefill_start, one_row.prefill_end) == (2, 7)


def test_flashinfer_multi_query_decode_only_step_with_window() -> None:
    scene = make_scene(decode_ctx=CTX, decode_q=ROWS, prefills=[], head_dim=64, seed=9)
    backend = FlashInferAttentionBackend(module=fake_flashinfer())
    got, cache = _attend(backend, scene, 3, scale=0.2)  # type: ignore[arg-type]
    torch.testing.assert_close(got.double(), reference(scene, cache, 3, 0.2), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("window", [0, 50])
def test_static_rows_per_request_match_the_rows_read_from_q_lens(window: int) -> None:
    """`static_q` (a verification CUDA graph's layout: every request has that many rows, so no
    shape is read from the device) gives the dynamic path's result in every backend."""
    scene = make_scene(decode_ctx=[9, 13, 30, 3], decode_q=[3, 3, 3, 3], prefills=[], head_dim=64, seed=7)
    dec = scene.meta.decode
    assert dec is not None
    static = dataclasses.replace(dec, q_starts=None, static_q=3)
    assert static.num_rows == 12 and static.q_starts.tolist() == [0, 3, 6, 9, 12]
    layout = query_rows(static)
    assert layout.q_max == 3 and layout.pad.tolist() == layout.keep.tolist() == list(range(12))
    fixed = dataclasses.replace(scene, meta=AttentionMetadata(scene.meta.slot_mapping, static, [], 12))
    for make in BACKENDS.values():
        want, _ = _attend(make(), scene, window)
        got, _ = _attend(make(), fixed, window)
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="static_q without q_lens"):
        DecodeBatch(1, dec.block_tables[:1], dec.ctx_lens[:1], 9, None, static_q=3)
