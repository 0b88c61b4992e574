"""Weight-only int8/int4 layers (kernels/quant_linear.py) against a reference dequantization.

The Q4_1 -> torch int4pack mapping is checked on random blocks with fp32 activations, where the
kernel's arithmetic is exact enough to show a wrong scale/zero or nibble order (those move outputs
by whole units): measured max |diff| ~3e-6 with outputs ~15. With bf16 activations (what the
engine runs) the kernel also wants its scales and zeros in bf16, so x, scale and zero are rounded:
measured max |diff| 0.066 with outputs ~10 (0.6%); `BF16_ATOL` allows 0.15.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.loader import Q4_1_BLOCK_BYTES, _q4_1_arrays
from kernels.quant_linear import GROUP, Int4Linear, Int8Linear, Q4Groups, quantize_q4

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
    got = Int4Linear(groups, act_dtype=torch.float32)(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, x @ w.T, atol=FP32_ATOL, rtol=0)


def test_int4_with_bf16_activations_stays_within_bf16_rounding() -> None:
    groups = random_groups(96, 64, seed=2)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    got = Int4Linear(groups)(x)
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
    layer = Int8Linear(w, act_dtype=torch.float32)
    deq = layer.dequantized()
    # symmetric rounding per row: within half a step of that row's scale
    assert ((deq - w).abs() <= w.abs().amax(1, keepdim=True) / 127 / 2 + 1e-6).all()
    x = torch.randn(4, 64, generator=g)
    torch.testing.assert_close(layer(x), x @ deq.T, atol=FP32_ATOL, rtol=0)
    torch.testing.assert_close(Int8Linear(w)(x), x @ deq.T, atol=BF16_ATOL, rtol=0)


def test_strided_activations_give_the_contiguous_result() -> None:
    """The model feeds the gate half of a fused gate-up output (a strided view)."""
    groups = random_groups(32, 64, seed=9)
    both = torch.randn(3, 128, generator=torch.Generator().manual_seed(10))
    strided, _ = both.chunk(2, dim=-1)
    for layer in (Int4Linear(groups), Int8Linear(groups.dequantize())):
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
    assert Int4Linear(groups).nbytes() == 64 * 128 // 2 + 64 * (128 // GROUP) * 2 * 2  # bf16 pairs
    assert Int8Linear(groups.dequantize()).nbytes() == 64 * 128 + 64 * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_weight_is_refused_loudly() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        Int8Linear(torch.zeros(4, 32, device="cuda"))
