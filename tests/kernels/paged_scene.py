"""A random paged-KV step laid out like the runner's, shared by the attention backend tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from halfmoon.kernels.attention import AttentionMetadata, DecodeBatch, PrefillSegment


@dataclass(slots=True)
class Scene:
    q: torch.Tensor  # [T, heads, head_dim]
    k: torch.Tensor  # [T, kv_heads, head_dim] new keys, written at meta.slot_mapping
    v: torch.Tensor
    cache: torch.Tensor  # [2, blocks, block_size, kv_heads, head_dim]
    meta: AttentionMetadata


def _slots(table: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    all_slots = (torch.tensor(table).unsqueeze(1) * block_size + torch.arange(block_size)).flatten()
    return all_slots[start:end]


def _decode_batch(tables: list[list[int]], ctx: list[int], block_size: int,
                  q_lens: list[int] | None = None) -> DecodeBatch:
    max_ctx = max(ctx)
    max_blocks = -(-max_ctx // block_size)
    block_tables = torch.zeros(len(ctx), max_blocks, dtype=torch.long)  # padded with block 0
    for i, (table, n) in enumerate(zip(tables, ctx, strict=True)):
        used = table[: -(-n // block_size)]
        block_tables[i, : len(used)] = torch.tensor(used)
    mask = None
    if min(ctx) != max_ctx:
        lengths = torch.tensor(ctx).unsqueeze(1)
        mask = (torch.arange(max_ctx) < lengths).view(len(ctx), 1, 1, max_ctx)
    lens = None if q_lens is None else torch.tensor(q_lens)
    return DecodeBatch(len(ctx), block_tables, torch.tensor(ctx), max_ctx, mask, lens)


def _prefill(table: list[int], cached: int, new: int, q_start: int,
             block_size: int) -> PrefillSegment:
    ctx = cached + new
    mask = None
    if cached:  # query i (position cached+i) sees keys 0..cached+i
        mask = torch.arange(ctx).unsqueeze(0) <= (torch.arange(new) + cached).unsqueeze(1)
    return PrefillSegment(q_start, new, torch.tensor(table[: -(-ctx // block_size)]), ctx, mask)


def make_scene(*, decode_ctx: list[int], prefills: list[tuple[int, int]], heads: int = 4,
               kv_heads: int = 2, head_dim: int = 16, block_size: int = 4, spare_blocks: int = 3,
               dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
               decode_q: list[int] | None = None) -> Scene:
    """Random cache and block tables; decodes first, then prefill chunks `(cached, new)`.
    `decode_q`: each decoding request's query rows (its last decode_q[i] tokens; None: one)."""
    g = torch.Generator().manual_seed(seed)
    q_lens = decode_q if decode_q is not None else [1] * len(decode_ctx)
    spans = [(c - n, n) for c, n in zip(decode_ctx, q_lens, strict=True)] + prefills
    need = [-(-(cached + new) // block_size) for cached, new in spans]
    perm = torch.randperm(sum(need) + spare_blocks, generator=g).tolist()
    tables = [perm[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(spans))]
    slot_mapping = torch.cat([_slots(t, c, c + n, block_size) for t, (c, n) in zip(tables, spans)])
    nd = len(decode_ctx)
    segments, q_start = [], sum(q_lens)
    for table, (cached, new) in zip(tables[nd:], prefills, strict=True):
        segments.append(_prefill(table, cached, new, q_start, block_size))
        q_start += new
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        decode=_decode_batch(tables[:nd], decode_ctx, block_size, decode_q) if nd else None,
        prefills=segments,
        num_tokens=q_start,
    )
    num_tokens = q_start

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype)

    return Scene(
        q=randn(num_tokens, heads, head_dim),
        k=randn(num_tokens, kv_heads, head_dim),
        v=randn(num_tokens, kv_heads, head_dim),
        cache=randn(2, len(perm), block_size, kv_heads, head_dim),
        meta=_to(meta, device),
    )


def _to(meta: AttentionMetadata, device: str) -> AttentionMetadata:
    def mv(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    dec = meta.decode
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping.to(device),
        decode=None if dec is None else DecodeBatch(dec.num, dec.block_tables.to(device),
                                                    dec.ctx_lens.to(device), dec.max_ctx, mv(dec.mask),
                                                    mv(dec.q_lens)),
        prefills=[PrefillSegment(s.q_start, s.q_len, s.block_table.to(device), s.ctx_len, mv(s.mask))
                  for s in meta.prefills],
        num_tokens=meta.num_tokens,
    )


def run_backend(backend: Any, scene: Scene, cache: torch.Tensor) -> torch.Tensor:
    heads, head_dim = scene.q.shape[1:]
    out = torch.full((scene.meta.num_tokens, heads * head_dim), float("nan"),
                     dtype=scene.q.dtype, device=scene.q.device)
    backend.write_kv(cache, scene.k, scene.v, scene.meta.slot_mapping)
    backend.forward(scene.q, cache, scene.meta, out)
    return out


MIXED = {"decode_ctx": [9, 1, 4, 13], "prefills": [(0, 7), (5, 6), (8, 1), (0, 4)]}
