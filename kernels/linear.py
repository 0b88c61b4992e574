"""Dense layers with the weight kept in the layout the CPU's GEMM library wants.

On CPU, oneDNN with a weight reordered once at load (what torch.compile's "freezing" does) is
faster than `F.linear` on a plain [out, in] weight at every batch size we measured: fp32
1.4-3.3x, bf16 1.0-1.9x (`halfmoon bench linear`, docs/BENCHMARKS.md). So on CPU each weight is
packed once and the plain copy is dropped. On CUDA (or if this torch
build lacks the oneDNN ops) the plain `F.linear` path is used, and `describe()` says which.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def onednn_available() -> bool:
    """True when this torch build has the oneDNN linear ops (x86 CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear:
    """y = x @ weight.T for x [T, in]; weight [out, in] given once, packed if worthwhile."""

    __slots__ = ("out_features", "in_features", "kind", "_weight")

    def __init__(self, weight: torch.Tensor, kind: str = "auto") -> None:
        if weight.dim() != 2:
            raise ValueError(f"Linear weight must be 2-D, got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        if kind == "auto":
            kind = "onednn" if weight.device.type == "cpu" and onednn_available() else "plain"
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
