"""bf16 dense layers on a CPU without oneDNN's bf16 path: kind "bf16-native" (kernels/linear.py).

Below BF16_DENSE_MIN_ROWS rows the layer runs kernels._qgemv's bf16 kernel, which widens each
bf16 weight to fp32 exactly and uses the activations exactly (fp32 ones as they are, bf16 ones
widened): what remains is fp32 accumulation, bounded by K * 2^-24 * sum_k |x_k w_k| (the
classical gamma_K bound), and a bf16 output's own round to nearest even (half an ulp: at most
2^-8 of the value). From BF16_DENSE_MIN_ROWS rows on it multiplies by a packed fp32 copy of the
weight (exact widening again), so the same bound holds on both sides of the threshold. The
reference is float64.
"""

from __future__ import annotations

import pytest
import torch

from halfmoon.kernels.linear import (
    BF16_DENSE_MIN_ROWS,
    NATIVE_KERNEL,
    Linear,
    auto_kind,
    onednn_available,
    qgemv,
)

native_only = pytest.mark.skipif(not NATIVE_KERNEL, reason="halfmoon.kernels._qgemv is not built")
fp32_onednn = pytest.mark.skipif(not onednn_available(), reason="no oneDNN linear ops in this torch")


def weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


def assert_within_bound(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """|got - x @ w.T| within fp32 accumulation's bound (+ bf16 output rounding), in float64."""
    exact = x.double() @ w.double().T
    bound = w.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().T) + 1e-30
    if got.dtype == torch.bfloat16:
        bound = bound * (1 + 2**-8) + exact.abs() * 2**-8
    assert got.dtype == x.dtype and got.shape == exact.shape
    excess = (got.double() - exact).abs() - bound
    assert (excess <= 0).all(), f"max excess over the bound {excess.max().item():.3g}"


# N: odd, so the last weight tile is short (tiles of 4 rows at M = 1, 2 otherwise);
# K: 7 (no full block of 16), 100 (6 blocks + 4), 576 (SmolLM2's hidden size)
SHAPES = [(37, 576), (73, 100), (5, 7)]
ROWS = sorted({1, 2, 3, 4, 5, 9, 17, BF16_DENSE_MIN_ROWS - 1, BF16_DENSE_MIN_ROWS, BF16_DENSE_MIN_ROWS + 1, 40})


@native_only
@fp32_onednn
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_native_matches_float64_at_every_row_count(n: int, k: int, rows: int, dtype: torch.dtype) -> None:
    w = weight(n, k, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    layer = Linear(w, "bf16-native")
    assert_within_bound(layer(x), x, w)


@native_only
@pytest.mark.parametrize("rows", [1, 6])
def test_bf16_native_reads_strided_activations(rows: int) -> None:
    """The gate half of a fused gate-up output is a view with row stride 2K."""
    w = weight(24, 96, seed=3)
    fused = torch.randn(rows, 2 * 96, generator=torch.Generator().manual_seed(4)).bfloat16()
    for x in (fused[:, :96], fused[:, 96:]):
        assert x.stride(0) == 2 * 96
        got = Linear(w, "bf16-native").few_rows(x)
        assert_within_bound(got, x, w)
        assert torch.equal(got, Linear(w, "bf16-native").few_rows(x.contiguous()))


@native_only
@pytest.mark.parametrize(("n", "k"), [*SHAPES, (64, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_the_plain_c_kernel_gives_what_the_avx2_one_gives(n: int, k: int, rows: int) -> None:
    """The portable path (CPUs without AVX2) sums in another order: equal to fp32 rounding."""
    if qgemv.kernel() != "avx2":
        pytest.skip("this CPU runs the plain kernel only")
    w = weight(n, k, seed=5)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(6))
    out = {plain: torch.empty(rows, n) for plain in (False, True)}
    for plain, y in out.items():
        qgemv.bf16_mm(x.data_ptr(), False, k, rows, k, w.data_ptr(), n, y.data_ptr(), False, n, plain)
    for y in out.values():
        assert_within_bound(y, x, w)
    torch.testing.assert_close(out[True], out[False], rtol=1e-4, atol=1e-4)  # measured max 2e-5


def test_auto_picks_onednn_then_bf16_native_then_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    w = weight(8, 32, seed=7)
    if onednn_available(torch.bfloat16):
        want = "onednn"
    else:
        want = "bf16-native" if NATIVE_KERNEL and onednn_available() else "plain"
    assert auto_kind(w) == want and Linear(w).kind == want
    assert auto_kind(w.float()) == ("onednn" if onednn_available() else "plain")
    monkeypatch.setattr("halfmoon.kernels.linear.NATIVE_KERNEL", False)
    if not onednn_available(torch.bfloat16):  # without the extension: the old plain path
        assert auto_kind(w) == "plain"
        torch.testing.assert_close(Linear(w)(w[:3].float().bfloat16()), w[:3] @ w.T)


@native_only
@fp32_onednn
def test_the_dense_copy_is_built_at_the_first_many_row_call_and_kept() -> None:
    w = weight(48, 64, seed=8)
    layer = Linear(w, "bf16-native")
    assert layer.nbytes() == 48 * 64 * 2 and layer._dense.nbytes() == 0
    layer(torch.randn(BF16_DENSE_MIN_ROWS - 1, 64))
    assert layer._dense.nbytes() == 0  # few rows never build it
    x = torch.randn(BF16_DENSE_MIN_ROWS, 64).bfloat16()
    assert_within_bound(layer(x), x, w)
    copy = layer._dense._linear
    assert copy is not None and copy.kind == "onednn" and layer._dense.nbytes() == 48 * 64 * 4
    layer(x)
    assert layer._dense._linear is copy and layer.nbytes() == 48 * 64 * 2  # what a decode call reads


@native_only
def test_bad_shapes_and_kinds_raise_value_error() -> None:
    w = weight(16, 64, seed=9)
    layer = Linear(w, "bf16-native")
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        layer(torch.randn(2, 32))
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        layer(torch.randn(2, 1, 64))
    with pytest.raises(ValueError, match="bf16 CPU weight"):
        Linear(w.float(), "bf16-native")
    with pytest.raises(ValueError, match="unknown linear kind"):
        Linear(w, "bf16")
    with pytest.raises(ValueError, match="2-D"):
        Linear(w.view(2, 8, 64))
    x, y = torch.randn(2, 64), torch.empty(2, 16)
    for m, k, stride in ((0, 64, 64), (2, 0, 64), (2, 64, 32)):
        with pytest.raises(ValueError):
            qgemv.bf16_mm(x.data_ptr(), False, stride, m, k, w.data_ptr(), 16, y.data_ptr(), False, 16)
    assert layer(torch.empty(0, 64)).shape == (0, 16)
