"""The fused decode calls (kernels/fused.py) against the torch ops they replace.

RoPE, the KV write, the attention output and the residual adds must be bit-identical to the
torch composition; the norm and SiLU (own reduction order and e^x) within a few fp32 ulp, or one
bf16 ulp.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from halfmoon.engine.model import apply_rope, rope_tables
from halfmoon.kernels import _fused, fused
from halfmoon.kernels.torch_backend import TorchAttentionBackend
from tests.kernels.paged_scene import make_scene

# (atol, rtol): fp32 a few ulp of values ~1-10; bf16 one ulp (2^-8 relative) of the output
TOL = {torch.float32: (1e-5, 2e-6), torch.bfloat16: (1e-6, 2**-7)}


def tables(head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's RoPE cos / signed sin tables for 128 positions."""
    cfg = SimpleNamespace(rope_theta=10000.0, head_dim=head_dim, max_position=128)
    return rope_tables(cfg, dtype)  # type: ignore[arg-type]


def test_fused_kernels_are_built() -> None:
    assert fused.AVAILABLE, "halfmoon.kernels._fused / _paged_attn were not built by `pip install -e .`"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 32])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_torch(dtype: torch.dtype, rows: int, with_delta: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    n = 576
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    # delta is a strided view (every other row of a wider tensor), as an output slice could be
    delta = torch.randn(rows, 2 * n, generator=g).to(dtype)[:, :n]
    w = (torch.randn(n, generator=g) * 0.3 + 1).to(dtype)
    want_x = x + delta if with_delta else x.clone()
    want = F.rms_norm(want_x, (n,), w, 1e-5)
    h = torch.full_like(x, float("nan"))
    _fused.add_rms_norm(x.data_ptr(), n, delta.data_ptr() if with_delta else 0, delta.stride(0),
                        w.data_ptr(), h.data_ptr(), n, rows, n, dtype == torch.bfloat16, 1e-5)
    assert torch.equal(x, want_x), "the residual add must round exactly as torch's x += delta"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(h, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_silu_mul_matches_torch(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    n = 1536
    gate_up = (torch.randn(rows, 2 * n, generator=g) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # e^x clamped at both ends
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate.clone()) * up
    out = torch.full((rows, n), float("nan"), dtype=dtype)
    _fused.silu_mul(gate_up.data_ptr(), 2 * n, out.data_ptr(), n, rows, n, dtype == torch.bfloat16)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode_ctx", [[1], [9, 1, 4, 13], [40, 3, 17, 64, 2, 33]])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (9, 3, 64)])
def test_decode_rope_equals_rope_write_kv_then_attention(
        dtype: torch.dtype, decode_ctx: list[int], heads: int, kv_heads: int,
        head_dim: int) -> None:
    """Ragged all-decode batches: the rotated q, the cache after the write and the attention
    output are bit-identical to apply_rope + write_kv + the native decode kernel."""
    scene = make_scene(decode_ctx=decode_ctx, prefills=[], heads=heads, kv_heads=kv_heads,
                       head_dim=head_dim, dtype=dtype)
    meta, t = scene.meta, len(decode_ctx)
    cos, sin = tables(head_dim, dtype)
    positions = torch.tensor(decode_ctx) - 1
    qkv = torch.cat([scene.q, scene.k, scene.v], dim=1).flatten(1)  # [T, (heads + 2 kv) * hd]

    want_cache = scene.cache.clone()
    want_out = torch.full((t, heads * head_dim), float("nan"), dtype=dtype)
    rows = qkv.view(t, heads + 2 * kv_heads, head_dim)
    qk = apply_rope(rows[:, : heads + kv_heads], cos[positions].unsqueeze(1),
                    sin[positions].unsqueeze(1))
    backend = TorchAttentionBackend()
    backend.write_kv(want_cache, qk[:, heads:], rows[:, heads + kv_heads :], meta.slot_mapping)
    backend.forward(qk[:, :heads], want_cache, meta, want_out)

    cache = scene.cache.clone().unsqueeze(0)  # one layer
    x = torch.zeros(t, 8, dtype=dtype)
    step = fused.DecodeStep(x, positions, (cos, sin), cache, meta, heads, 1e-5)
    got_qkv = qkv.clone()
    out = step.attend(0, got_qkv)
    assert torch.equal(got_qkv.view(t, -1, head_dim)[:, :heads], qk[:, :heads]), "q, in place"
    assert torch.equal(cache[0], want_cache), "K rotated and V copied to their slots, nothing else"
    assert torch.equal(out, want_out)


def test_decode_step_rejects_rows_of_another_dtype_or_shape() -> None:
    scene = make_scene(decode_ctx=[3, 5], prefills=[])
    step = fused.DecodeStep(torch.zeros(2, 8), torch.tensor([2, 4]), tables(16, torch.float32),
                            scene.cache.unsqueeze(0), scene.meta, 4, 1e-5)
    with pytest.raises(ValueError, match="expected"):
        step.attend(0, torch.zeros(2, 8 * 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="expected"):
        step.silu_mul(torch.zeros(3, 10))


@pytest.mark.parametrize("rows", [1, 8])  # 8 x 1536: past NATIVE_ACT_MAX_ELEMENTS, torch's ops
def test_decode_step_silu_mul_for_few_and_many_rows(rows: int) -> None:
    scene = make_scene(decode_ctx=[2] * rows, prefills=[])
    step = fused.DecodeStep(torch.zeros(rows, 8), torch.ones(rows, dtype=torch.long),
                            tables(16, torch.float32),
                            scene.cache.unsqueeze(0), scene.meta, 4, 1e-5)
    gate_up = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(0))
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    torch.testing.assert_close(step.silu_mul(gate_up), want, atol=1e-5, rtol=2e-6)


def test_norm_weights_of_another_dtype_or_layout_turn_the_native_step_off() -> None:
    ones = torch.ones(8)
    assert fused.weights_supported([ones, ones], torch.float32)
    assert not fused.weights_supported([ones, ones.bfloat16()], torch.float32)
    assert not fused.weights_supported([torch.ones(8, 2)[:, 0]], torch.float32)  # strided
    assert not fused.weights_supported([ones.half()], torch.float16)


# ---------------------------------------------------------------- the model families' additions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_gelu_tanh_mul_matches_torch(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    n = 1536
    gate_up = (torch.randn(rows, 2 * n, generator=g) * 4).to(dtype)
    # e^x clamped at both ends, x^3 overflowing to +-inf, zeros
    gate_up[0, :6] = torch.tensor([-100.0, 100.0, 0.0, -0.0, -1e13, 1e13])
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    out = torch.full((rows, n), float("nan"), dtype=dtype)
    _fused.gelu_tanh_mul(gate_up.data_ptr(), 2 * n, out.data_ptr(), n, rows, n,
                         dtype == torch.bfloat16)
    # torch's 0.5 x (1 + tanh y) cancels for gate < ~-2 (its gelu up to ~4e-7 off the exact
    # value, then times |up| <~ 16); x * sigmoid(2y) does not: an absolute tolerance there
    atol, rtol = {torch.float32: (1e-5, 2e-6), torch.bfloat16: (1e-5, 2**-7)}[dtype]
    torch.testing.assert_close(out, want, atol=atol, rtol=rtol)
    if dtype == torch.float32:  # where torch does not cancel: a few ulp of the exact value
        x = gate.double()
        exact = 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3)))
        exact *= up.double()
        keep = (x > -2) & (x.abs() < 1e6)
        rel = ((out.double() - exact).abs() / exact.abs().clamp_min(1e-30))[keep]
        assert rel.max() < 1e-6


def _step(rows: int, dtype: torch.dtype = torch.float32, **kw: object) -> fused.DecodeStep:
    scene = make_scene(decode_ctx=[2] * rows, prefills=[], dtype=dtype)
    return fused.DecodeStep(torch.zeros(rows, 8, dtype=dtype), torch.ones(rows, dtype=torch.long),
                            tables(16, dtype), scene.cache.unsqueeze(0), scene.meta, 4, 1e-5,
                            **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8])  # 8 x 1536: past NATIVE_ACT_MAX_ELEMENTS, torch's ops
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_decode_step_act_mul(dtype: torch.dtype, rows: int, activation: str) -> None:
    step = _step(rows, dtype)
    gate_up = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(0)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(step.act_mul(gate_up.clone(), activation), act * up,
                               atol=max(atol, 1e-6), rtol=rtol)


def test_decode_step_refuses_an_unknown_activation() -> None:
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        _step(1).act_mul(torch.zeros(1, 10), "relu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 6])
def test_decode_step_rms_norm_matches_torch(dtype: torch.dtype, rows: int) -> None:
    """A branch's output normalised on its own (Gemma's post norms): x and t left as they are."""
    g = torch.Generator().manual_seed(rows)
    hidden = 576
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    scene = make_scene(decode_ctx=[2] * rows, prefills=[], dtype=dtype)
    step = fused.DecodeStep(x, torch.ones(rows, dtype=torch.long), tables(16, dtype),
                            scene.cache.unsqueeze(0), scene.meta, 4, 1e-6)
    t = (torch.randn(rows, 2 * hidden, generator=g) * 5).to(dtype)[:, :hidden]  # strided rows
    w = (torch.randn(hidden, generator=g) * 0.3 + 1).to(dtype)
    x0, t0 = x.clone(), t.clone()
    got = step.rms_norm(t, w)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, F.rms_norm(t0, (hidden,), w, 1e-6), atol=atol, rtol=rtol)
    assert torch.equal(x, x0) and torch.equal(t, t0)
    assert got.data_ptr() not in (x.data_ptr(), step.h.data_ptr(), t.data_ptr())
    # the next layer's add consumes it as its delta
    h = step.add_rms_norm(got, w)
    assert torch.equal(step.x, x0 + got)
    torch.testing.assert_close(h, F.rms_norm(x0 + got, (hidden,), w, 1e-6), atol=atol, rtol=rtol)


def _torch_attend(scene, qkv, heads, kv_heads, head_dim, cos, sin, positions, *, window=0,
                  scale=None, q_norm=None, k_norm=None, eps=1e-5):  # type: ignore[no-untyped-def]
    """The torch composition decode_rope replaces: q / k norm, RoPE, write_kv, attention."""
    t = qkv.shape[0]
    rows = qkv.view(t, heads + 2 * kv_heads, head_dim)
    q, k = rows[:, :heads], rows[:, heads : heads + kv_heads]
    if q_norm is not None:
        q = F.rms_norm(q, (head_dim,), q_norm, eps)
    if k_norm is not None:
        k = F.rms_norm(k, (head_dim,), k_norm, eps)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q, k = apply_rope(q, c, s), apply_rope(k, c, s)
    cache = scene.cache.clone()
    out = torch.full((t, heads * head_dim), float("nan"), dtype=qkv.dtype)
    backend = TorchAttentionBackend()
    backend.write_kv(cache, k, rows[:, heads + kv_heads :], scene.meta.slot_mapping)
    backend.forward(q, cache, scene.meta, out, window=window, scale=scale)
    return q, cache, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (8, 4, 256)])
def test_decode_rope_with_layer_tables_window_and_scale_is_bit_identical(
        dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    """A Gemma 3 local layer without q / k norm: its own RoPE tables (another theta), a window,
    its scale: bit-identical to the torch RoPE + write_kv + native decode."""
    ctx = [40, 3, 17, 64, 2, 33]
    scene = make_scene(decode_ctx=ctx, prefills=[], heads=heads, kv_heads=kv_heads,
                       head_dim=head_dim, dtype=dtype, seed=8)
    cos, sin = tables(head_dim, dtype)
    local = rope_tables(SimpleNamespace(rope_theta=10.0, head_dim=head_dim,  # type: ignore[arg-type]
                                        max_position=128), dtype)
    positions = torch.tensor(ctx) - 1
    qkv = torch.cat([scene.q, scene.k, scene.v], dim=1).flatten(1)
    want_q, want_cache, want_out = _torch_attend(scene, qkv, heads, kv_heads, head_dim, *local,
                                                 positions, window=5, scale=0.125)
    cache = scene.cache.clone().unsqueeze(0)
    step = fused.DecodeStep(torch.zeros(len(ctx), 8, dtype=dtype), positions, (cos, sin), cache,
                            scene.meta, heads, 1e-5, scale=0.125)
    got_qkv = qkv.clone()
    out = step.attend(0, got_qkv, rope=local, window=5)
    assert torch.equal(got_qkv.view(len(ctx), -1, head_dim)[:, :heads], want_q)
    assert torch.equal(cache[0], want_cache)
    assert torch.equal(out, want_out)
    # and the constructor's tables, full attention, are another result
    assert not torch.equal(step.attend(0, qkv.clone()), want_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (9, 3, 64), (8, 2, 256)])
@pytest.mark.parametrize("which", ["q", "k", "both"])
def test_decode_rope_with_q_k_norm_matches_norm_then_rope(
        dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, which: str) -> None:
    """Qwen3 / Gemma 3: each query head and the K head RMS-normalised over head_dim, scaled by
    its weight, then rotated; within the norm's few fp32 ulp (one bf16 ulp) of the torch
    composition. V is copied untouched and no other slot changes."""
    ctx = [9, 1, 4, 13, 40]
    scene = make_scene(decode_ctx=ctx, prefills=[], heads=heads, kv_heads=kv_heads,
                       head_dim=head_dim, dtype=dtype, seed=head_dim)
    g = torch.Generator().manual_seed(1)
    q_norm = (torch.randn(head_dim, generator=g) * 0.3 + 1).to(dtype) if which != "k" else None
    k_norm = (torch.randn(head_dim, generator=g) * 0.3 + 1).to(dtype) if which != "q" else None
    cos, sin = tables(head_dim, dtype)
    positions = torch.tensor(ctx) - 1
    qkv = (torch.cat([scene.q, scene.k, scene.v], dim=1).flatten(1) * 3).to(dtype)
    want_q, want_cache, want_out = _torch_attend(scene, qkv, heads, kv_heads, head_dim, cos, sin,
                                                 positions, q_norm=q_norm, k_norm=k_norm,
                                                 eps=1e-6)
    cache = scene.cache.clone().unsqueeze(0)
    step = fused.DecodeStep(torch.zeros(len(ctx), 8, dtype=dtype), positions, (cos, sin), cache,
                            scene.meta, heads, 1e-6)
    got_qkv = qkv.clone()
    out = step.attend(0, got_qkv, q_norm=q_norm, k_norm=k_norm)
    t = len(ctx)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got_qkv.view(t, -1, head_dim)[:, :heads], want_q, atol=atol,
                               rtol=rtol)
    assert torch.equal(got_qkv[:, heads * head_dim :], qkv[:, heads * head_dim :]), "k, v as given"
    flat, want_flat = (c.view(2, -1, kv_heads, head_dim) for c in (cache[0], want_cache))
    slots = scene.meta.slot_mapping
    torch.testing.assert_close(flat[0][slots], want_flat[0][slots], atol=atol, rtol=rtol)
    assert torch.equal(flat[1], want_flat[1]), "V copied, nothing else written"
    others = torch.ones(flat.shape[1], dtype=torch.bool)
    others[slots] = False
    assert torch.equal(flat[0][others], want_flat[0][others])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, want_out, atol=tol, rtol=tol)
    if which == "q":  # K unnormalised: exactly the torch RoPE of it
        assert torch.equal(flat[0][slots], want_flat[0][slots])


def test_attend_refuses_norm_weights_and_tables_it_cannot_read() -> None:
    step = _step(2)
    qkv = torch.zeros(2, 8 * 16)
    with pytest.raises(ValueError, match=r"\[16\] torch.float32 q / k norm"):
        step.attend(0, qkv, q_norm=torch.ones(8))
    with pytest.raises(ValueError, match="q / k norm"):
        step.attend(0, qkv, k_norm=torch.ones(16, dtype=torch.bfloat16))
    cos, sin = tables(16, torch.float32)
    with pytest.raises(ValueError, match="RoPE table"):
        step.attend(0, qkv, rope=(cos, sin[:, :8]))


def test_supported_takes_every_layers_rope_tables() -> None:
    scene = make_scene(decode_ctx=[3, 5], prefills=[])
    x, cache = torch.zeros(2, 8), scene.cache.unsqueeze(0)
    glob, local = tables(16, torch.float32), tables(16, torch.float32)
    assert fused.supported(x, cache, scene.meta, 4, glob)  # today's (cos, sin)
    assert fused.supported(x, cache, scene.meta, 4, [*glob, *local])  # flat
    assert fused.supported(x, cache, scene.meta, 4, [glob, local])  # pairs
    strided = (local[0].t().contiguous().t(), local[1])
    assert not fused.supported(x, cache, scene.meta, 4, [glob, strided])
    assert not fused.supported(x, cache, scene.meta, 4, [glob, tuple(t.bfloat16() for t in local)])
    assert not fused.supported(x, cache, scene.meta, 4, [glob, tables(32, torch.float32)])


def test_decode_step_keeps_alive_what_it_took_addresses_of() -> None:
    """The calls pass raw addresses: the step holds the tensors, not just their addresses."""
    import gc
    import weakref

    scene = make_scene(decode_ctx=[3, 5], prefills=[])
    positions, cache = torch.tensor([2, 4]), scene.cache.clone().unsqueeze(0)
    cos, sin = tables(16, torch.float32)
    refs = [weakref.ref(t) for t in (positions, cache, cos, sin)]
    step = fused.DecodeStep(torch.zeros(2, 8), positions, (cos, sin), cache, scene.meta, 4, 1e-5)
    del positions, cache, cos, sin
    gc.collect()
    assert all(r() is not None for r in refs)
    assert not torch.isnan(step.attend(0, torch.randn(2, 8 * 16))).any()
