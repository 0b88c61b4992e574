"""Attention over the paged KV layout: the interface both backends implement.

Device KV layout (docs/ARCHITECTURE.md, "KV layout"): one tensor per worker

    kv_cache: [layers, 2, num_blocks, block_size, kv_heads, head_dim]   (2 = K, V)

A request owns a block table; token t of a request lives in slot
`block_table[t // block_size] * block_size + t % block_size` of the flattened
`[num_blocks * block_size]` axis.

A step's tokens are laid out flat, decodes first, then prefill chunks:

    | decode q (1 token per request) ... | prefill chunk 0 | prefill chunk 1 | ...

Metadata is built once per step and reused by every layer.

A layer may attend through a sliding window of W tokens (Mistral; Gemma 3's local layers), HF's
`sliding_window_overlay`: the query at position p sees the keys at positions (p - W, p], the last
W tokens including its own; window 0 is full causal attention. A backend builds what a window
needs (masks, trimmed block tables, plans) once per (step, window) and every layer of that
window reuses it: `AttentionMetadata.window_cache`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class PrefillSegment:
    """One request's prefill chunk: queries [q_start, q_start+q_len) of the flat batch.

    ```
    | cached / earlier chunks (ctx_len - q_len) | this chunk (q_len) |
    ```
    It attends to the first `ctx_len` tokens of the blocks in `block_table`
    ([ceil(ctx_len / block_size)] int64). `mask` is None when the chunk starts at position 0
    (plain causal), else a [q_len, ctx_len] bool mask (True = visible).
    """

    q_start: int
    q_len: int
    block_table: torch.Tensor
    ctx_len: int
    mask: torch.Tensor | None


@dataclass(slots=True)
class DecodeBatch:
    """`num` single-token queries at the head of the flat batch.

    `block_tables` is [num, max_blocks] int64 (rows padded with block 0); request i attends to
    its first `ctx_lens[i]` tokens. `mask` is [num, 1, 1, max_ctx] (True = real key) or None
    when every request has `max_ctx` tokens of context.
    """

    num: int
    block_tables: torch.Tensor
    ctx_lens: torch.Tensor
    max_ctx: int
    mask: torch.Tensor | None


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step, shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    decode: DecodeBatch | None
    prefills: list[PrefillSegment]
    num_tokens: int
    # a backend's per-step derivations keyed by what they depend on (e.g. ("decode", window)):
    # built by the first layer that needs one, reused by the rest of the step's layers
    window_cache: dict[Any, Any] = field(default_factory=dict)


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and computes attention for a flat batch."""

    name: str = "base"

    def write_kv(self, layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store k, v ([T, kv_heads, head_dim]) into `layer_cache` ([2, blocks, bs, kvh, hd]).

        One scatter by slot on the flattened `[blocks * block_size]` axis: the cache layout is
        the same for every backend and the scatter is valid on CPU and CUDA, so they share it.
        """
        kv_heads, head_dim = layer_cache.shape[-2:]
        flat = layer_cache.view(2, -1, kv_heads, head_dim)
        flat[0].index_copy_(0, slot_mapping, k)
        flat[1].index_copy_(0, slot_mapping, v)

    @abstractmethod
    def forward(self, q: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata,
                out: torch.Tensor, window: int = 0, scale: float | None = None) -> torch.Tensor:
        """q: [T, heads, head_dim] -> `out` [T, heads * head_dim] (written in place).

        `window`: the layer's sliding window in tokens (0 = full causal attention); `scale`: the
        softmax scale of q . k (None = head_dim ** -0.5; Gemma 3: query_pre_attn_scalar ** -0.5).
        """


def get_backend(name: str) -> AttentionBackend:
    """Backend registry; the flashinfer one is imported only when asked for (CUDA only)."""
    if name == "torch":
        from kernels.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "flashinfer":
        from kernels.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r} (choose 'torch' or 'flashinfer')")
