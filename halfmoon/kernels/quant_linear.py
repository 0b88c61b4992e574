"""Weight-only quantized dense layers for the CPU: int8 per output channel, int4 in groups of 32.

    int8: w[n, k] = scale[n] * q[n, k]                       q in -127..127 (symmetric)
    int4: w[n, k] = scale[n, g] * q[n, k] + minimum[n, g]    q in 0..15, g = k // GROUP

The int4 form is a Q4_1 GGUF block's own (d = scale, m = minimum, both fp16), so a Q4_1 model is
loaded without re-quantizing (`Q4Groups`, engine/loader.py).

Which kernel a call runs depends on its row count M (`Backend`):

    M < DENSE_MIN_ROWS  native kernels._qgemv (kernels/_qgemv.c): the activation rows are
                        quantized to int8 in blocks of 32 and each block's dot product is done in
                        integers (llama.cpp's scheme); the weights are streamed once per call.
    M >= DENSE_MIN_ROWS the layer's weight dequantized once to fp32, kept, and multiplied by
                        the packed fp32 GEMM (kernels/linear.py): exact to the dequantized
                        weight, and 2-3x faster than any quantized kernel at prefill's row counts
                        on an AVX2 CPU (docs/BENCHMARKS.md, issue 23, fourteenth session).

Without the native extension (no C compiler at install) the few-row path is torch's CPU kernels
(`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`), logged loudly at import (by
kernels/linear.py, which loads the extension and holds the call wrapper and dense copy this file
shares with bf16 layers). Those convert every weight to float (~6 GB/s of packed weights on AVX2)
and run ~10x slower with fp32 activations than with bf16, so they take bf16 activations, scales
and zeros (bf16 keeps 8 of the fp16 scale's 11 significant bits). torch's int4 kernel dequantizes a group as
`(q - 8) * scale + zero`: `zero = minimum + 8 * scale` maps the two exactly.

The native kernel's only approximation is the activation's int8 rounding: per element at most
max |x| of its block / 254 (tests/kernels/test_quant_linear.py asserts this bound). Every path
is CPU-only: a weight on another device is a `ValueError`, never a silent fallback.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch

from halfmoon.kernels.linear import NATIVE_KERNEL, DenseCopy, native_mm, qgemv

GROUP = 32  # Q4_1's block: the int4 group along the input dimension
INT8_MAX = 127
INT4_MAX = 15
INT4_ZERO_POINT = 8  # torch's int4 kernel subtracts this from every q
Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
# From this many rows on, a layer multiplies by its dequantized fp32 weight (packed GEMM): the
# crossover measured by `halfmoon bench linear --quantized` (docs/BENCHMARKS.md).
DENSE_MIN_ROWS = 32
# int8 layers keep torch's kernel unless asked (`Int8Linear(native=True)`): int8 weights with the
# native kernel's int8 activations measured worse greedy agreement with fp32 (0/8 prompts
# identical, 28% of tokens, vs 2/8 and 44%) and failed tests/engine/test_quantization.py's int8
# bounds (docs/BENCHMARKS.md, fourteenth session). int4 weights with it measured as before.
INT8_NATIVE_DEFAULT = False


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


    def blocks(self) -> torch.Tensor:
        """uint8 [out, in // GROUP * 20]: a row's Q4_1 blocks as kernels/_qgemv.c reads them,
        | nibbles: 16 bytes a block | d: fp16 a block | m: fp16 a block |, element j < 16 of a
        block the low nibble of its byte j, element j + 16 the high one (GGUF's order). Exact
        when scale and minimum are fp16 values (a GGUF's, `quantize_q4`'s)."""
        n, k = _check_groups(self.q)
        q = self.q.view(n, k // GROUP, GROUP)
        nibbles = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, -1)
        d, m = (t.half().contiguous().view(torch.uint8) for t in (self.scale, self.minimum))
        return torch.cat([nibbles, d, m], dim=1).contiguous()


def dequantize_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """fp32 [out, in] from the rows of Q4_1 blocks `Q4Groups.blocks` gives."""
    n, nb = blocks.shape[0], blocks.shape[1] // Q4_1_BLOCK_BYTES
    nibbles = blocks[:, :nb * 16].reshape(n, nb, 16)
    d, m = (blocks[:, nb * o:nb * (o + 2)].contiguous().view(torch.float16).float().unsqueeze(-1) for o in (16, 18))
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()
    return (q * d + m).view(n, nb * GROUP)


def quantize_q4(weight: torch.Tensor) -> Q4Groups:
    """Q4_1's rounding of a float weight [out, in] (for sources that are not Q4_1 already):
    per group, minimum = min, scale = (max - min) / 15, both rounded to fp16 as a Q4_1 block
    stores them, q = round((w - minimum) / scale)."""
    n, k = _check_groups(weight)
    groups = weight.float().view(n, k // GROUP, GROUP)
    low, high = groups.amin(-1).half().float(), groups.amax(-1)
    scale = ((high - low) / INT4_MAX).half().float()
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
    """y = x @ dequant(w).T with w int8 per output channel."""

    __slots__ = ("out_features", "in_features", "kind", "act_dtype", "native", "_weight", "_scale",
                 "_scale_act", "_dense")

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype = torch.bfloat16, native: bool | None = None) -> None:
        """Quantize a float weight [out, in]: scale = max |w| of the row / 127 (symmetric).
        `native`: the C kernel for few rows and the dequantized copy for many (default: off,
        `INT8_NATIVE_DEFAULT`); `act_dtype`: the activation dtype of torch's kernel."""
        _check_cpu(weight, "int8")
        if weight.dim() != 2:
            raise ValueError(f"Linear weight must be 2-D, got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.native = _want_native(INT8_NATIVE_DEFAULT if native is None else native, self.in_features)
        w = weight.float()
        scale = w.abs().amax(dim=1) / INT8_MAX
        inverse = torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)
        self._weight = (w * inverse.unsqueeze(1)).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8).contiguous()
        self._scale = scale.contiguous()
        self._scale_act = scale.to(act_dtype)
        self.act_dtype = act_dtype
        self._dense = DenseCopy()
        self.kind = "int8"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.shape[0] >= DENSE_MIN_ROWS:
            return self.dense_rows(x)
        return self.few_rows(x)

    def dense_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The dequantized fp32 copy at any row count (what a native layer runs from DENSE_MIN_ROWS)."""
        return self._dense(x, self.dequantized)

    def few_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The quantized kernel at any row count (what `__call__` runs below DENSE_MIN_ROWS)."""
        if self.native:
            return native_mm(x, self.in_features, self.out_features, qgemv.q8_mm, self._weight.data_ptr(),
                             self._scale.data_ptr())
        # The kernels read A as contiguous without checking (int8) or refuse it (int4): the
        # gate half of a fused gate-up output is a strided view.
        y = torch.ops.aten._weight_int8pack_mm(x.to(self.act_dtype).contiguous(), self._weight, self._scale_act)
        return y.to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight this layer multiplies by."""
        return self._weight.float() * self._scale.unsqueeze(1)

    def input_shard(self, cols: slice) -> Int8Linear:
        """The input columns `cols` of this layer (a tensor-parallel row-parallel shard), each row
        keeping the whole row's scale: the shard multiplies by exactly the weights this layer does."""
        shard = copy.copy(self)
        shard._weight = self._weight[:, cols].contiguous()
        shard.in_features = shard._weight.shape[1]
        if self.native and shard.in_features % GROUP:
            raise ValueError(f"the native int8 kernel needs input columns in blocks of {GROUP}, got {shard.in_features}")
        shard._dense = DenseCopy()
        return shard

    def nbytes(self) -> int:
        """Bytes of weight (and scales) one few-row call reads."""
        return self._weight.numel() + self._scale.numel() * 4


class Int4Linear:
    """y = x @ dequant(w).T with w 4-bit in groups of 32 (Q4_1 blocks)."""

    __slots__ = ("out_features", "in_features", "kind", "act_dtype", "native", "_groups", "_blocks",
                 "_packed", "_scale_zero", "_dense")

    def __init__(self, groups: Q4Groups, act_dtype: torch.dtype = torch.bfloat16, native: bool | None = None) -> None:
        """`native`: the C kernel for few rows (default: when built), else torch's kernel with
        `act_dtype` activations."""
        _check_cpu(groups.q, "int4")
        self.out_features, self.in_features = _check_groups(groups.q)
        if not (0 <= int(groups.q.min()) and int(groups.q.max()) <= INT4_MAX):
            raise ValueError("int4 weights must lie in 0..15")
        self.native = _want_native(native, self.in_features)
        self.act_dtype = act_dtype
        self._groups = self._blocks = self._packed = self._scale_zero = None
        if self.native:
            self._blocks = groups.blocks()
        else:
            self._groups = groups  # for the dense copy
            self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.q.to(torch.int32).contiguous(), 1)
            zero = groups.minimum.float() + INT4_ZERO_POINT * groups.scale.float()
            # [in // GROUP, out, 2]: the kernel's layout of (scale, zero) pairs
            self._scale_zero = torch.stack([groups.scale.float(), zero], dim=-1).transpose(0, 1).contiguous().to(act_dtype)
        self._dense = DenseCopy()
        self.kind = "int4"

    @classmethod
    def from_float(cls, weight: torch.Tensor, act_dtype: torch.dtype = torch.bfloat16,
                   native: bool | None = None) -> Int4Linear:
        """Quantize a float weight with Q4_1's rounding (`quantize_q4`)."""
        return cls(quantize_q4(weight), act_dtype, native)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_rows(x) if x.shape[0] >= DENSE_MIN_ROWS else self.few_rows(x)

    def dense_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The dequantized fp32 copy at any row count (what `__call__` runs from DENSE_MIN_ROWS)."""
        return self._dense(x, self.dequantized)

    def few_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The quantized kernel at any row count (what `__call__` runs below DENSE_MIN_ROWS)."""
        if self._blocks is not None:
            return native_mm(x, self.in_features, self.out_features, qgemv.q4_mm, self._blocks.data_ptr())
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(self.act_dtype).contiguous(), self._packed, GROUP,
                                                       self._scale_zero)
        return y.to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight [out, in] this layer multiplies by."""
        return self._groups.dequantize() if self._blocks is None else dequantize_blocks(self._blocks)

    def nbytes(self) -> int:
        """Bytes of packed weight and scales one few-row call reads."""
        if self._blocks is not None:
            return self._blocks.numel()
        return self._packed.numel() * self._packed.element_size() + \
            self._scale_zero.numel() * self._scale_zero.element_size()


def _want_native(native: bool | None, in_features: int) -> bool:
    if native and not NATIVE_KERNEL:
        raise ValueError("the native int8/int4 kernel (kernels._qgemv) is not built")
    return NATIVE_KERNEL and in_features % GROUP == 0 if native is None else native
