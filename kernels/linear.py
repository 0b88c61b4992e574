"""Dense layers with the weight kept in the layout the CPU's GEMM library wants.

On CPU, oneDNN with a weight reordered once at load (what torch.compile's "freezing" does) is
faster than `F.linear` on a plain [out, in] weight at every batch size we measured: fp32
1.4-3.3x, bf16 1.0-1.9x (`halfmoon bench linear`, docs/BENCHMARKS.md). So on CPU each weight is
packed once and the plain copy is dropped. On CUDA, where this torch build lacks the oneDNN
ops, or for bf16 on a CPU whose oneDNN has no bf16 path (it needs AVX512-BW/VL/DQ or
AVX-NE-CONVERT; e.g. an AVX2-only EPYC), the plain `F.linear` path is used and logged once;
`kind` says which.
"""

from __future__ import annotations

import functools
import logging
from typing import Protocol

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """True when this torch build has the oneDNN linear ops (x86 CPU builds do) and, for bf16,
    this CPU has oneDNN's bf16 path."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or _onednn_bf16()


@functools.cache
def _onednn_bf16() -> bool:
    supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if not supported:
        log.warning("this CPU has no oneDNN bf16 path (AVX512-BW/VL/DQ or AVX-NE-CONVERT): bf16 "
                    "dense layers use F.linear on the plain weight (slower than packed)")
    return supported


class DenseLayer(Protocol):
    """What the model calls: `Linear` here, `Int8Linear`/`Int4Linear` (kernels/quant_linear.py)."""

    out_features: int
    in_features: int
    kind: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def nbytes(self) -> int: ...


class Linear:
    """y = x @ weight.T for x [T, in]; weight [out, in] given once, packed if worthwhile."""

    __slots__ = ("out_features", "in_features", "kind", "_weight")

    def __init__(self, weight: torch.Tensor, kind: str = "auto") -> None:
        if weight.dim() != 2:
            raise ValueError(f"Linear weight must be 2-D, got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        if kind == "auto":
            kind = "onednn" if weight.device.type == "cpu" and onednn_available(weight.dtype) else "plain"
        if kind == "onednn":
            self._weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        elif kind == "plain":
            self._weight = weight.contiguous()
        else:
            raise ValueError(f"unknown linear kind {kind!r} (auto, onednn, plain)")
        self.kind = kind

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self._weight, None, "none", [], "")
        return F.linear(x, self._weight)

    def nbytes(self) -> int:
        """Bytes of weight one call reads."""
        return self.out_features * self.in_features * self._weight.element_size()
