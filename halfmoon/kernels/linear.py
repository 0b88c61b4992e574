"""Dense layers with the weight kept in the layout the CPU's GEMM library wants.

On CPU, oneDNN with a weight reordered once at load (what torch.compile's "freezing" does) is
faster than `F.linear` on a plain [out, in] weight at every batch size we measured: fp32
1.4-3.3x, bf16 1.0-1.9x (`halfmoon bench linear`, docs/BENCHMARKS.md). So on CPU each weight is
packed once and the plain copy is dropped (kind "onednn").

A bf16 weight on a CPU whose oneDNN has no bf16 path (it needs AVX512-BW/VL/DQ or
AVX-NE-CONVERT; e.g. an AVX2-only EPYC) gets kind "bf16-native":

    M < BF16_DENSE_MIN_ROWS  kernels._qgemv's bf16 kernel (kernels/_qgemv.c): the bf16 weight
                             streamed once per call, widened to fp32 in registers, x used
                             exactly, fp32 accumulation.
    M >= BF16_DENSE_MIN_ROWS an fp32 copy of the weight packed for oneDNN, built at the first
                             such call and kept: 2x the bf16 weight's memory (SmolLM2-135M: +425
                             MB for the layers at the first prefill, +113 MB for the tied head
                             once a step samples that many rows; building them took 0.45 s and
                             0.13 s, once) for the fp32 GEMM's speed.

There `F.linear` on the bf16 weight (kind "plain") streams ~11-14 GB/s at one row (the C kernel
~16-17) and is 4x slower than the C kernel at 16 rows, 8x slower than the packed fp32 GEMM at
256 (`halfmoon bench linear --quantized`). Kind "plain" is what CUDA gets (this torch build lacks the
oneDNN ops there), and what a bf16 weight gets without the C extension (logged loudly). `kind`
says which; the choice for bf16 is logged once.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

try:  # after torch: the extension then shares torch's OpenMP runtime (kernels/_qgemv.c)
    from halfmoon.kernels import _qgemv as qgemv
except ImportError as e:  # pragma: no cover - depends on the install
    qgemv = None
    log.warning("halfmoon.kernels._qgemv is not built (%s): int8/int4 layers fall back to torch's CPU kernels, "
                "~2-3x slower at decode, and bf16 layers on a CPU without oneDNN bf16 to F.linear, "
                "~2-8x slower; reinstall with a C compiler (pip install -e .)", e)

NATIVE_KERNEL = qgemv is not None
# From this many rows on a "bf16-native" layer multiplies by its packed fp32 copy: the crossover
# on an AVX2 EPYC, 2 threads (`halfmoon bench linear --quantized`, issue 23): the C kernel was
# 1.03-1.29x the copy's speed at 16 rows, 0.85-1.14x at 20, 0.85-0.92x at 24, 0.72-0.77x at 32
# (it does M x N x K fp32 FMAs like the GEMM, at about half of oneDNN's efficiency).
BF16_DENSE_MIN_ROWS = 20
KINDS = ("auto", "onednn", "bf16-native", "plain")


def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """True when this torch build has the oneDNN linear ops (x86 CPU builds do) and, for bf16,
    this CPU has oneDNN's bf16 path."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or _onednn_bf16()


@functools.cache
def _onednn_bf16() -> bool:
    supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if supported:
        return True
    if NATIVE_KERNEL:
        log.warning("this CPU has no oneDNN bf16 path (AVX512-BW/VL/DQ or AVX-NE-CONVERT): bf16 dense "
                    "layers run kernels._qgemv's bf16 kernel below %d rows and a packed fp32 copy of "
                    "the weight (2x its memory, built at first use) from there", BF16_DENSE_MIN_ROWS)
    else:
        log.warning("this CPU has no oneDNN bf16 path (AVX512-BW/VL/DQ or AVX-NE-CONVERT) and "
                    "halfmoon.kernels._qgemv is not built: bf16 dense layers use F.linear on the plain weight, "
                    "2-8x slower; reinstall with a C compiler (pip install -e .)")
    return False


def auto_kind(weight: torch.Tensor) -> str:
    """The fastest kind this build and CPU have for `weight` (module docstring)."""
    if weight.device.type != "cpu":
        return "plain"
    if onednn_available(weight.dtype):
        return "onednn"
    if weight.dtype == torch.bfloat16 and NATIVE_KERNEL and onednn_available(torch.float32):
        return "bf16-native"
    return "plain"


class DenseLayer(Protocol):
    """What the model calls: `Linear` here, `Int8Linear`/`Int4Linear` (kernels/quant_linear.py)."""

    out_features: int
    in_features: int
    kind: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def nbytes(self) -> int: ...


class DenseCopy:
    """A layer's weight as fp32 packed for oneDNN, built at the first call that needs it and
    kept (for a bf16 or quantized layer's many-row calls); x is cast to fp32 and back."""

    __slots__ = ("_linear",)

    def __init__(self) -> None:
        self._linear: Linear | None = None

    def __call__(self, x: torch.Tensor, weight: Callable[[], torch.Tensor]) -> torch.Tensor:
        """x @ weight().T; `weight` gives the fp32 [out, in] weight, called once."""
        if self._linear is None:
            self._linear = Linear(weight().float())
        return self._linear(x.float()).to(x.dtype)

    def nbytes(self) -> int:
        """Bytes the copy holds (0 until built)."""
        return 0 if self._linear is None else self._linear.nbytes()


def native_mm(x: torch.Tensor, in_features: int, out_features: int, call: Callable[..., None],
              *weight: int) -> torch.Tensor:
    """y = x @ W.T by a kernels._qgemv product (`call`, W's addresses in `weight`); x [M, K]
    fp32/bf16 (other dtypes go through fp32), y in x's dtype."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        return native_mm(x.float(), in_features, out_features, call, *weight).to(x.dtype)
    if not x.is_cpu:
        raise ValueError(f"the native kernels run on CPU; the activations are on {x.device}")
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"activations must be [M, {in_features}], got shape {tuple(x.shape)}")
    m, k = x.shape
    if x.stride(-1) != 1 or (m > 1 and x.stride(0) < k):  # e.g. an expanded row
        x = x.contiguous()
    y = torch.empty(m, out_features, dtype=x.dtype)
    if m == 0:
        return y
    bf16 = x.dtype == torch.bfloat16
    stride = x.stride(0) if m > 1 else k  # a single row's stride can be anything
    args = (x.data_ptr(), bf16, stride, m, k, *weight, out_features, y.data_ptr(), bf16, out_features)
    if torch.autograd._profiler_enabled():  # not a torch op: name it for the profiler ("linear" in it)
        with torch.profiler.record_function("linear_native"):
            call(*args)
    else:
        call(*args)
    return y


class Linear:
    """y = x @ weight.T for x [T, in]; weight [out, in] given once, packed if worthwhile."""

    __slots__ = ("out_features", "in_features", "kind", "_weight", "_dense")

    def __init__(self, weight: torch.Tensor, kind: str = "auto") -> None:
        if weight.dim() != 2:
            raise ValueError(f"Linear weight must be 2-D, got shape {tuple(weight.shape)}")
        if kind not in KINDS:
            raise ValueError(f"unknown linear kind {kind!r} ({', '.join(KINDS)})")
        self.out_features, self.in_features = weight.shape
        self.kind = auto_kind(weight) if kind == "auto" else kind
        if self.kind == "bf16-native":
            _check_bf16_native(weight)
        self._dense = DenseCopy()  # "bf16-native"'s, built at its first many-row call
        # a tied head's weight stays the embedding's own storage (contiguous already)
        self._weight = weight.contiguous()
        if self.kind == "onednn":
            self._weight = torch.ops.mkldnn._reorder_linear_weight(self._weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self._weight, None, "none", [], "")
        if self.kind == "bf16-native":
            return self.dense_rows(x) if x.shape[0] >= BF16_DENSE_MIN_ROWS else self.few_rows(x)
        return F.linear(x, self._weight)

    def few_rows(self, x: torch.Tensor) -> torch.Tensor:
        """A "bf16-native" layer's C kernel at any row count (`__call__` runs it below
        BF16_DENSE_MIN_ROWS)."""
        return native_mm(x, self.in_features, self.out_features, qgemv.bf16_mm, self._weight.data_ptr())

    def dense_rows(self, x: torch.Tensor) -> torch.Tensor:
        """A "bf16-native" layer's packed fp32 copy at any row count (built at the first call)."""
        return self._dense(x, self._weight.float)

    def nbytes(self) -> int:
        """Bytes of weight one call reads (a few-row call, for "bf16-native")."""
        return self.out_features * self.in_features * self._weight.element_size()


def _check_bf16_native(weight: torch.Tensor) -> None:
    if not NATIVE_KERNEL:
        raise ValueError("linear kind 'bf16-native' needs kernels._qgemv, which is not built")
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        raise ValueError(f"linear kind 'bf16-native' takes a bf16 CPU weight, "
                         f"got {weight.dtype} on {weight.device}")
