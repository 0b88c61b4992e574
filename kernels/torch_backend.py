"""Paged attention in plain torch (CPU and CUDA): gather the keys by slot, then SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def write_kv(self, layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        kv_heads, head_dim = layer_cache.shape[-2:]
        flat = layer_cache.view(2, -1, kv_heads, head_dim)
        flat[0].index_copy_(0, slot_mapping, k)
        flat[1].index_copy_(0, slot_mapping, v)

    def forward(self, q: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata,
                out: torch.Tensor) -> torch.Tensor:
        kv_heads, head_dim = layer_cache.shape[-2:]
        flat = layer_cache.view(2, -1, kv_heads, head_dim)
        if meta.decode is not None and meta.decode.num:
            self._decode(q, flat, meta, out)
        for seg in meta.prefills:
            qs = q[seg.q_start : seg.q_start + seg.q_len].transpose(0, 1).unsqueeze(0)
            k = flat[0][seg.kv_slots].transpose(0, 1).unsqueeze(0)
            v = flat[1][seg.kv_slots].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qs, k, v, attn_mask=seg.mask, is_causal=seg.mask is None, enable_gqa=True
            )
            out[seg.q_start : seg.q_start + seg.q_len] = o[0].transpose(0, 1).flatten(1)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, flat: torch.Tensor, meta: AttentionMetadata,
                out: torch.Tensor) -> None:
        dec = meta.decode
        assert dec is not None
        qd = q[: dec.num].unsqueeze(2)  # [B, H, 1, D]
        k = flat[0][dec.kv_slots].transpose(1, 2)  # [B, KVH, L, D]
        v = flat[1][dec.kv_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=dec.mask, enable_gqa=True)
        out[: dec.num] = o.flatten(1)
