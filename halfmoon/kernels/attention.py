"""Attention over the paged KV layout: the interface both backends implement.

Device KV layout (docs/ARCHITECTURE.md, "KV layout"): one tensor per worker

    kv_cache: [layers, 2, num_blocks, block_size, kv_heads, head_dim]   (2 = K, V)

A request owns a block table; token t of a request lives in slot
`block_table[t // block_size] * block_size + t % block_size` of the flattened
`[num_blocks * block_size]` axis.

A step's tokens are laid out flat, decodes first, then prefill chunks:

    | decode q (1 token per request) ... | prefill chunk 0 | prefill chunk 1 | ...

A decoding request may bring several query rows (speculative decoding's verify step: its last
token and k drafted ones; `DecodeBatch.q_lens`). Its rows are adjacent, in position order, and
its `ctx_lens` entry counts them all: with n rows and ctx keys, row j (0-based) is the token at
position ctx - n + j and sees the keys at positions < ctx - n + j + 1 (causal within the
request's rows), under a window W only the last W of those:

    | decode: req 0 (n0 rows) | req 1 (n1 rows) | ... | prefill chunk 0 | ...
             ^ q_starts[0]     ^ q_starts[1]           ^ q_starts[num] = num_rows

    request i:  | cached (ctx - n) | new: row 0 .. row n-1 |   all n written before any attends

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
import torch.nn.functional as F


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
    """`num` decoding requests' query rows at the head of the flat batch.

    `block_tables` is [num, max_blocks] int64 (rows padded with block 0); request i attends to
    its first `ctx_lens[i]` tokens (its new ones included). `mask` is [num, 1, 1, max_ctx]
    (True = real key) or None when every request has `max_ctx` tokens of context; it is the
    one-row layout's and the backends ignore it when `q_lens` is given.

    `q_lens` (int64 [num], each 1..ctx_lens[i]; None = one row per request) gives each
    request's query rows; `q_starts` (int64 [num + 1], their prefix sums from 0) is derived from
    it when not given. Request i's rows are [q_starts[i], q_starts[i + 1]) of the flat batch;
    row q_starts[i] + j sees the keys at positions < ctx_lens[i] - q_lens[i] + j + 1 (module
    docstring). Both live on ctx_lens's device.

    `static_q` > 0: every request has exactly that many rows (a verification CUDA graph's
    layout, engine/cuda_graphs.py), so the rows and q_max are known without reading q_lens on
    the device (a graph cannot hold `int(q_lens.max())`); 0: read from q_lens / q_starts.
    """

    num: int
    block_tables: torch.Tensor
    ctx_lens: torch.Tensor
    max_ctx: int
    mask: torch.Tensor | None
    q_lens: torch.Tensor | None = None
    q_starts: torch.Tensor | None = None
    static_q: int = 0
    _rows: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.q_lens is None:
            if self.q_starts is not None or self.static_q:
                raise ValueError("DecodeBatch: q_starts without q_lens" if self.static_q == 0
                                 else "DecodeBatch: static_q without q_lens")
            self._rows = self.num
            return
        if self.q_lens.shape != (self.num,):
            raise ValueError(f"DecodeBatch: q_lens is [{self.num}], got {tuple(self.q_lens.shape)}")
        if self.static_q:  # nothing read back from the device: a CUDA graph records this
            if self.q_starts is None:
                self.q_starts = torch.arange(self.num + 1, device=self.q_lens.device) * self.static_q
            self._rows = self.num * self.static_q
            return
        if self.q_starts is None:
            self.q_starts = F.pad(self.q_lens.cumsum(0), (1, 0))
        self._rows = int(self.q_starts[-1])  # once per step (a device sync on CUDA)

    @property
    def num_rows(self) -> int:
        """The decode rows of the flat batch: `num`, or the sum of `q_lens`."""
        return self._rows

    @property
    def multi_query(self) -> bool:
        """Whether some request may have more than one row (q_lens given)."""
        return self.q_lens is not None


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

    def __post_init__(self) -> None:
        """The flat layout (module docstring): the prefill chunks follow the decode rows back
        to back. A chunk placed after the decode *requests* instead of their rows read a
        verification's queries as its own (a mixed step's wrong tokens, engine/runner.py)."""
        at = self.decode.num_rows if self.decode is not None else 0
        for seg in self.prefills:
            if seg.q_start != at:
                raise ValueError(f"a prefill chunk starts at row {seg.q_start}, not at {at} (after the "
                                 "decode rows and the chunks before it)")
            at += seg.q_len


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
        from halfmoon.kernels.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "flashinfer":
        from halfmoon.kernels.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r} (choose 'torch' or 'flashinfer')")
