"""Weight-only quantized dense layers for the CPU: int8 per output channel, int4 in groups of 32.

    int8: w[n, k] = scale[n] * q[n, k]                       q in -127..127 (symmetric)
    int4: w[n, k] = scale[n, g] * q[n, k] + minimum[n, g]    q in 0..15, g = k // GROUP

The int4 form is a Q4_1 GGUF block's own (d = scale, m = minimum), so a Q4_1 model is loaded
without re-quantizing (`Q4Groups`, engine/loader.py). torch's CPU int4 kernel
(`_weight_int4pack_mm_for_cpu`) dequantizes a group as `(q - 8) * scale + zero`, so
`zero = minimum + 8 * scale` maps the two exactly with fp32 activations
(tests/kernels/test_quant_linear.py).

Both kernels run ~10x slower with fp32 activations than with bf16 on an AVX2 CPU (measured per
shape of SmolLM2 at 1, 16 and 256 rows, docs/BENCHMARKS.md, issue 23), so by default they take
bf16 activations: an fp32 model's activations are cast to bf16 for the matmul and back. The
kernels then want their scales (and int4 zeros) in the activation dtype too: bf16 keeps 8 of the
fp16 scale's 11 significant bits, an error of ~1/64 of a 4-bit step (the 4-bit values themselves
are the source's). The torch ops are CPU-only: a weight on another device is a `ValueError`,
never a silent fallback.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

GROUP = 32  # Q4_1's block: the int4 group along the input dimension
INT8_MAX = 127
INT4_MAX = 15
INT4_ZERO_POINT = 8  # torch's int4 kernel subtracts this from every q


class Q4Groups(NamedTuple):
    """Group-wise asymmetric 4-bit weights [out, in]: w = scale * q + minimum per group of GROUP."""

    q: torch.Tensor  # uint8 [out, in], values 0..15
    scale: torch.Tensor  # fp32 [out, in // GROUP]
    minimum: torch.Tensor  # fp32 [out, in // GROUP]

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out, in] these groups stand for."""
        n, k = self.q.shape
        groups = self.q.view(n, k // GROUP, GROUP).float()
        return (groups * self.scale.unsqueeze(-1) + self.minimum.unsqueeze(-1)).view(n, k)

    @staticmethod
    def cat(parts: list[Q4Groups]) -> Q4Groups:
        """Stacked along the output dimension (fused QKV / gate-up), as `torch.cat(dim=0)`."""
        return Q4Groups(*(torch.cat(list(t), dim=0) for t in zip(*parts)))


def quantize_q4(weight: torch.Tensor) -> Q4Groups:
    """Q4_1's rounding of a float weight [out, in] (for sources that are not Q4_1 already):
    per group, minimum = min, scale = (max - min) / 15, q = round((w - min) / scale)."""
    n, k = _check_groups(weight)
    groups = weight.float().view(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low) / INT4_MAX
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)
    q = ((groups - low.unsqueeze(-1)) * inverse.unsqueeze(-1)).round().clamp(0, INT4_MAX)
    return Q4Groups(q.to(torch.uint8).view(n, k), scale, low)


def _check_groups(weight: torch.Tensor) -> tuple[int, int]:
    if weight.dim() != 2:
        raise ValueError(f"quantized linear weight must be 2-D, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"int4 needs the input dimension to be a multiple of {GROUP}, got {k}")
    return n, k


def _check_cpu(weight: torch.Tensor, kind: str) -> None:
    if weight.device.type != "cpu":
        raise ValueError(f"{kind} weight-only quantization runs on CPU only (torch's CPU kernels); "
                         f"the weight is on {weight.device}: use --quantization none there")


class Int8Linear:
    """y = x @ dequant(w).T with w int8 per output channel (`_weight_int8pack_mm`)."""

    __slots__ = ("out_features", "in_features", "kind", "act_dtype", "_weight", "_scale")

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype = torch.bfloat16) -> None:
        """Quantize a float weight [out, in]: scale = max |w| of the row / 127 (symmetric)."""
        _check_cpu(weight, "int8")
        if weight.dim() != 2:
            raise ValueError(f"Linear weight must be 2-D, got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        w = weight.float()
        scale = w.abs().amax(dim=1) / INT8_MAX
        inverse = torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)
        self._weight = (w * inverse.unsqueeze(1)).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8).contiguous()
        self._scale = scale.to(act_dtype)
        self.act_dtype = act_dtype
        self.kind = "int8"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # The kernels read A as contiguous without checking (int8) or refuse it (int4): the
        # gate half of a fused gate-up output is a strided view.
        y = torch.ops.aten._weight_int8pack_mm(x.to(self.act_dtype).contiguous(), self._weight, self._scale)
        return y.to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight this layer multiplies by (for checks)."""
        return self._weight.float() * self._scale.float().unsqueeze(1)

    def nbytes(self) -> int:
        """Bytes of weight (and scales) one call reads."""
        return self._weight.numel() + self._scale.numel() * self._scale.element_size()


class Int4Linear:
    """y = x @ dequant(w).T with w 4-bit in groups of 32 (`_weight_int4pack_mm_for_cpu`)."""

    __slots__ = ("out_features", "in_features", "kind", "act_dtype", "_packed", "_scale_zero")

    def __init__(self, groups: Q4Groups, act_dtype: torch.dtype = torch.bfloat16) -> None:
        _check_cpu(groups.q, "int4")
        self.out_features, self.in_features = _check_groups(groups.q)
        if not (0 <= int(groups.q.min()) and int(groups.q.max()) <= INT4_MAX):
            raise ValueError("int4 weights must lie in 0..15")
        self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.q.to(torch.int32).contiguous(), 1)
        zero = groups.minimum.float() + INT4_ZERO_POINT * groups.scale.float()
        # [in // GROUP, out, 2]: the kernel's layout of (scale, zero) pairs
        self._scale_zero = torch.stack([groups.scale.float(), zero], dim=-1).transpose(0, 1).contiguous().to(act_dtype)
        self.act_dtype = act_dtype
        self.kind = "int4"

    @classmethod
    def from_float(cls, weight: torch.Tensor, act_dtype: torch.dtype = torch.bfloat16) -> Int4Linear:
        """Quantize a float weight with Q4_1's rounding (`quantize_q4`)."""
        return cls(quantize_q4(weight), act_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(self.act_dtype).contiguous(), self._packed, GROUP,
                                                       self._scale_zero)
        return y.to(x.dtype)

    def nbytes(self) -> int:
        """Bytes of packed weight and (scale, zero) pairs one call reads."""
        return self._packed.numel() * self._packed.element_size() + \
            self._scale_zero.numel() * self._scale_zero.element_size()
