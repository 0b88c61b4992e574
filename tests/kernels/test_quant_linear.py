"""Weight-only int8/int4 layers (kernels/quant_linear.py) against a reference dequantization.

torch's kernels (the fallback, `native=False`): the Q4_1 -> torch int4pack mapping is checked on random blocks with fp32 activations, where the
kernel's arithmetic is exact enough to show a wrong scale/zero or nibble order (those move outputs
by whole units): measured max |diff| ~3e-6 with outputs ~15. With bf16 activations (what the
engine runs) the kernel also wants its scales and zeros in bf16, so x, scale and zero are rounded:
measured max |diff| 0.066 with outputs ~10 (0.6%); `BF16_ATOL` allows 0.15.

The native kernel (kernels/_qgemv.c) rounds each activation block of 32 to int8 and is otherwise
exact in its integer dot products, so it is checked two ways: against the same rounding written
in torch (float64 sums; what remains is fp32 accumulation order, ~1e-6 of the output: rtol 1e-5),
and against the exact product x @ dequant(W).T with the bound that rounding implies,
|y - y_exact| <= sum_b max|x_b| / 254 * sum_{j in b} |w_j| (plus the output's own bf16 rounding
where the output is bf16). From DENSE_MIN_ROWS rows on a layer multiplies by its fp32
dequantized weight: equal to x @ dequant(W).T within fp32 GEMM rounding (`FP32_ATOL`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from halfmoon.engine.loader import Q4_1_BLOCK_BYTES, _q4_1_arrays
from halfmoon.kernels.quant_linear import (DENSE_MIN_ROWS, GROUP, NATIVE_KERNEL, Int4Linear, Int8Linear, Q4Groups,
                                  dequantize_blocks, quantize_q4)

FP32_ATOL = 1e-4
BF16_ATOL = 0.15


def random_groups(n: int, k: int, seed: int = 0) -> Q4Groups:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    # fp16-representable scales and minimums, as a GGUF stores them
    scale = (torch.rand(n, k // GROUP, generator=g) * 0.1).half().float()
    minimum = (torch.randn(n, k // GROUP, generator=g) * 0.1).half().float()
    return Q4Groups(q, scale, minimum)


def reference_q4_1(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """ggml's Q4_1 dequantization written out loop by loop: w[r, 32b + j] = d[r, b] * q + m[r, b]."""
    rows, cols = q.shape
    w = np.empty((rows, cols), dtype=np.float32)
    for r in range(rows):
        for b in range(cols // GROUP):
            w[r, b * GROUP:(b + 1) * GROUP] = d[r, b] * q[r, b * GROUP:(b + 1) * GROUP] + m[r, b]
    return w


def test_int4_matches_the_q4_1_dequantization_exactly_in_fp32() -> None:
    groups = random_groups(64, 128)
    w = torch.from_numpy(reference_q4_1(groups.q.numpy(), groups.scale.numpy(), groups.minimum.numpy()))
    assert torch.equal(groups.dequantize(), w)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    got = Int4Linear(groups, act_dtype=torch.float32, native=False)(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, x @ w.T, atol=FP32_ATOL, rtol=0)


def test_int4_with_bf16_activations_stays_within_bf16_rounding() -> None:
    groups = random_groups(96, 64, seed=2)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    got = Int4Linear(groups, native=False)(x)
    assert got.dtype == x.dtype  # fp32 in, fp32 out: the cast to bf16 is internal
    torch.testing.assert_close(got, x @ groups.dequantize().T, atol=BF16_ATOL, rtol=0)


def test_q4_1_blocks_are_read_in_ggml_order() -> None:
    """Bytes of real Q4_1 blocks (d, m as fp16, then 16 bytes: element j low nibble of byte j,
    element j + 16 its high nibble) decode to the loop-by-loop reference."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(4).standard_normal((6, 64)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType.Q4_1)
    assert raw.size == 6 * 64 // GROUP * Q4_1_BLOCK_BYTES
    q, d, m = _q4_1_arrays(raw.reshape(-1), 6, 64)
    np.testing.assert_array_equal(reference_q4_1(q, d, m), dequantize(raw, GGMLQuantizationType.Q4_1))
    assert q.max() <= 15


def test_quantize_q4_roundtrip_error_is_within_half_a_step() -> None:
    w = torch.randn(32, 96, generator=torch.Generator().manual_seed(5))
    groups = quantize_q4(w)
    step = groups.scale.repeat_interleave(GROUP, dim=1)
    assert ((groups.dequantize() - w).abs() <= step / 2 + 1e-6).all()


def test_cat_stacks_along_the_output_dimension() -> None:
    a, b = random_groups(8, 64, seed=6), random_groups(4, 64, seed=7)
    assert torch.equal(Q4Groups.cat([a, b]).dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


def test_int8_is_per_output_channel_and_matches_its_dequantization() -> None:
    g = torch.Generator().manual_seed(8)
    w = torch.randn(48, 64, generator=g) * torch.logspace(-2, 0, 48).unsqueeze(1)  # rows of every scale
    layer = Int8Linear(w, act_dtype=torch.float32, native=False)
    deq = layer.dequantized()
    # symmetric rounding per row: within half a step of that row's scale
    assert ((deq - w).abs() <= w.abs().amax(1, keepdim=True) / 127 / 2 + 1e-6).all()
    x = torch.randn(4, 64, generator=g)
    torch.testing.assert_close(layer(x), x @ deq.T, atol=FP32_ATOL, rtol=0)
    torch.testing.assert_close(Int8Linear(w, native=False)(x), x @ deq.T, atol=BF16_ATOL, rtol=0)


def test_strided_activations_give_the_contiguous_result() -> None:
    """The model feeds the gate half of a fused gate-up output (a strided view)."""
    groups = random_groups(32, 64, seed=9)
    both = torch.randn(3, 128, generator=torch.Generator().manual_seed(10))
    strided, _ = both.chunk(2, dim=-1)
    for native in (False, True)[:1 + NATIVE_KERNEL]:
        for layer in (Int4Linear(groups, native=native), Int8Linear(groups.dequantize(), native=native)):
            torch.testing.assert_close(layer(strided), layer(strided.contiguous()), atol=0, rtol=0)


def test_bad_shapes_and_values_are_precise_errors() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q4(torch.zeros(4, 40))
    with pytest.raises(ValueError, match="2-D"):
        Int8Linear(torch.zeros(4))
    bad = random_groups(4, 32)
    with pytest.raises(ValueError, match="0..15"):
        Int4Linear(Q4Groups(bad.q + 16, bad.scale, bad.minimum))


def test_nbytes_counts_packed_weights_and_scales() -> None:
    groups = random_groups(64, 128)
    blocks = 64 * (128 // GROUP)
    assert Int4Linear(groups, native=False).nbytes() == 64 * 128 // 2 + blocks * 2 * 2  # bf16 pairs
    assert Int8Linear(groups.dequantize()).nbytes() == 64 * 128 + 64 * 4  # fp32 scales
    assert not Int8Linear(groups.dequantize()).native  # INT8_NATIVE_DEFAULT
    if NATIVE_KERNEL:
        assert Int4Linear(groups, native=True).nbytes() == blocks * 20  # Q4_1 blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_weight_is_refused_loudly() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        Int8Linear(torch.zeros(4, 32, device="cuda"))


# ---------------------------------------------------------------- the native kernel

native_only = pytest.mark.skipif(not NATIVE_KERNEL, reason="halfmoon.kernels._qgemv is not built")


def int8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation rounding in torch: per block of 32, d = max|x| / 127 and
    q = round-half-even(x * (1 / d)) in fp32; returns (q [M, K] float64, d [M, K / 32] float64)."""
    m, k = x.shape
    blocks = x.float().view(m, k // GROUP, GROUP)
    d = blocks.abs().amax(-1) / 127
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse.unsqueeze(-1))
    return q.view(m, k).double(), d.double()


def rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, N]: sum over blocks b of max|x_b| / 254 * sum_{j in b} |w[n, j]| (what the int8
    rounding of x can move an output by)."""
    m, k = x.shape
    half_step = x.double().abs().view(m, k // GROUP, GROUP).amax(-1) / 254
    w_abs = w.double().abs().view(w.shape[0], k // GROUP, GROUP).sum(-1)
    return half_step @ w_abs.T


SHAPES = [(40, 32), (72, 576), (24, 1536)]  # blocks: 1 (no 8-block pass), 18 (8 + 8 + 2), 48


@native_only
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, DENSE_MIN_ROWS - 1])
def test_native_int4_equals_the_same_rounding_written_in_torch(n: int, k: int, rows: int) -> None:
    groups = random_groups(n, k, seed=n + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k + rows))
    got = Int4Linear(groups, native=True)(x)
    xq, dx = int8_blocks(x)
    q = groups.q.double().view(n, k // GROUP, GROUP)
    dots = torch.einsum("mbj,nbj->mnb", xq.view(rows, k // GROUP, GROUP), q)
    sums = x.double().view(rows, k // GROUP, GROUP).sum(-1)
    want = (dots * dx.unsqueeze(1) * groups.scale.double()).sum(-1) + sums @ groups.minimum.double().T
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    exact = x.double() @ groups.dequantize().double().T
    assert ((got.double() - exact).abs() <= rounding_bound(x, groups.dequantize()) + 1e-5).all()


@native_only
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 5, DENSE_MIN_ROWS - 1])
def test_native_int8_equals_the_same_rounding_written_in_torch(n: int, k: int, rows: int) -> None:
    g = torch.Generator().manual_seed(n * k + rows)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n).unsqueeze(1)
    layer = Int8Linear(w, native=True)
    x = torch.randn(rows, k, generator=g)
    got = layer(x)
    xq, dx = int8_blocks(x)
    qw = torch.round(layer.dequantized().double() / layer._scale.double().unsqueeze(1))
    dots = torch.einsum("mbj,nbj->mnb", xq.view(rows, k // GROUP, GROUP), qw.view(n, k // GROUP, GROUP))
    want = (dots * dx.unsqueeze(1)).sum(-1) * layer._scale.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    exact = x.double() @ layer.dequantized().double().T
    assert ((got.double() - exact).abs() <= rounding_bound(x, layer.dequantized()) + 1e-5).all()


@native_only
def test_native_bf16_in_and_out_stays_within_the_rounding_bound() -> None:
    """bf16 activations are exact inputs to the int8 rounding; the output adds its bf16 rounding
    (half an ulp: 2^-9 of the value)."""
    groups = random_groups(64, 576, seed=11)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(12)).bfloat16()
    got = Int4Linear(groups, native=True)(x)
    assert got.dtype == torch.bfloat16
    exact = x.double() @ groups.dequantize().double().T
    bound = rounding_bound(x.float(), groups.dequantize()) * (1 + 2**-8) + exact.abs() * 2**-8 + 1e-5
    assert ((got.double() - exact).abs() <= bound).all()


@native_only
def test_native_kernel_is_close_to_exact_on_smooth_activations() -> None:
    """Not only within the bound: on Gaussian activations the int8 rounding moves outputs by
    ~0.5% of their scale (measured max 0.3%; asserted 1.5%)."""
    groups = random_groups(256, 576, seed=13)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(14))
    exact = x @ groups.dequantize().T
    err = (Int4Linear(groups, native=True)(x) - exact).abs().max() / exact.abs().max()
    assert err < 0.015


@pytest.mark.parametrize("native", [False, True][:1 + NATIVE_KERNEL])
def test_many_rows_multiply_by_the_dequantized_weight(native: bool) -> None:
    groups = random_groups(48, 64, seed=15)
    x = torch.randn(DENSE_MIN_ROWS + 3, 64, generator=torch.Generator().manual_seed(16))
    layers = [(Int4Linear(groups, native=native), groups.dequantize())]
    if native:  # an int8 layer on torch's kernel runs it at every row count
        layers.append((Int8Linear(groups.dequantize(), native=True), None))
    for layer, w in layers:
        w = layer.dequantized() if w is None else w
        torch.testing.assert_close(layer(x), x @ w.T, atol=FP32_ATOL, rtol=0)
        assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_blocks_hold_the_groups_exactly() -> None:
    groups = random_groups(12, 96, seed=17)
    blocks = groups.blocks()
    assert blocks.shape == (12, 96 // GROUP * 20) and blocks.dtype == torch.uint8
    assert torch.equal(dequantize_blocks(blocks), groups.dequantize())


def test_quantize_q4_stores_fp16_scales_as_q4_1_does() -> None:
    groups = quantize_q4(torch.randn(8, 64, generator=torch.Generator().manual_seed(18)))
    for t in (groups.scale, groups.minimum):
        assert torch.equal(t.half().float(), t)


@native_only
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_plain_c_kernel_gives_what_the_avx2_one_gives(n: int, k: int) -> None:
    """The portable path (CPUs without AVX2) runs the same arithmetic in another order."""
    from halfmoon.kernels import _qgemv

    groups = random_groups(n, k, seed=19)
    int4 = Int4Linear(groups, native=True)
    int8 = Int8Linear(groups.dequantize(), native=True)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(20))
    for call, weight in ((_qgemv.q4_mm, (int4._blocks.data_ptr(),)),
                         (_qgemv.q8_mm, (int8._weight.data_ptr(), int8._scale.data_ptr()))):
        ys = [torch.empty(3, n) for _ in range(2)]
        for y, plain in zip(ys, (False, True)):
            call(x.data_ptr(), False, k, 3, k, *weight, n, y.data_ptr(), False, n, plain)
        torch.testing.assert_close(ys[1], ys[0], rtol=1e-5, atol=1e-5)


@native_only
def test_native_edge_inputs_empty_batch_and_fp16() -> None:
    layer = Int4Linear(random_groups(16, 64, seed=21), native=True)
    assert layer(torch.empty(0, 64)).shape == (0, 16)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(22))
    got = layer(x.half())
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), layer(x.half().float()), atol=1e-2, rtol=1e-3)
    row = torch.randn(64, generator=torch.Generator().manual_seed(23))
    expanded = row.expand(3, 64)  # row stride 0
    torch.testing.assert_close(layer(expanded), layer(expanded.contiguous()), atol=0, rtol=0)
    torch.testing.assert_close(layer(expanded[:1]), layer(row.unsqueeze(0)), atol=0, rtol=0)
