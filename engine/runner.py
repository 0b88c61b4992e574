"""Turns a scheduled batch into model inputs, runs the model, samples.

Flat layout of a step (decodes first so they share one batched attention call):

    | d_0 | d_1 | ... | d_{B-1} | prefill chunk 0 ...... | prefill chunk 1 .. |
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from core.blocks import cdiv
from engine.model import LayerHook, LlamaModel
from engine.request import Request
from engine.sampler import sample
from engine.scheduler import ScheduledRequest
from kernels.attention import AttentionMetadata, DecodeBatch, PrefillSegment


class StepInputs:
    __slots__ = ("input_ids", "positions", "meta", "logits_rows", "sampled")

    def __init__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 logits_rows: torch.Tensor, sampled: list[Request]) -> None:
        self.input_ids = input_ids
        self.positions = positions
        self.meta = meta
        self.logits_rows = logits_rows
        self.sampled = sampled


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self._offsets = torch.arange(block_size)
        self.layer_hook: LayerHook | None = None

    def run(self, scheduled: Sequence[ScheduledRequest]) -> list[int]:
        """One forward pass over the batch; returns a token per request whose `sample` is set."""
        inputs = self.prepare(scheduled)
        logits = self.model.forward(inputs.input_ids, inputs.positions, self.kv_cache,
                                    inputs.meta, inputs.logits_rows, self.layer_hook)
        if not inputs.sampled:
            return []
        return sample(logits, inputs.sampled)

    def prepare(self, scheduled: Sequence[ScheduledRequest]) -> StepInputs:
        """Flat inputs in runner order (decodes first); sampled rows in *scheduler* order.

        The scheduler consumes the sampled tokens in its own order, so `logits_rows`/`sampled`
        follow `scheduled`, not the flat layout.
        """
        decodes = [s for s in scheduled if s.num_tokens == 1]
        prefills = [s for s in scheduled if s.num_tokens > 1]
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        last_row: dict[str, int] = {}
        # Each block table becomes a tensor once per step; slots and attention metadata share it.
        tables = {s.request.request_id: torch.tensor(s.request.block_table) for s in scheduled}
        for s in decodes + prefills:
            start = s.request.num_computed_tokens
            table = tables[s.request.request_id]
            ids.extend(s.request.token_ids[start : start + s.num_tokens])
            positions.append(torch.arange(start, start + s.num_tokens))
            slots.append(self._slots(table, start, start + s.num_tokens))
            last_row[s.request.request_id] = len(ids) - 1
        sampled = [s.request for s in scheduled if s.sample]
        rows = [last_row[r.request_id] for r in sampled]
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            decode=self._decode_batch(decodes, tables) if decodes else None,
            prefills=self._prefill_segments(prefills, len(decodes), tables),
            num_tokens=len(ids),
        )
        return StepInputs(torch.tensor(ids), torch.cat(positions), meta,
                          torch.tensor(rows, dtype=torch.long), sampled)

    def _slots(self, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Cache slots of positions [start, end) for a request's block table."""
        all_slots = (table.unsqueeze(1) * self.block_size + self._offsets).flatten()
        return all_slots[start:end]

    def _decode_batch(self, decodes: list[ScheduledRequest], tables: dict[str, torch.Tensor]) -> DecodeBatch:
        ctx = [s.request.num_computed_tokens + 1 for s in decodes]
        max_ctx = max(ctx)
        max_blocks = cdiv(max_ctx, self.block_size)
        padded = torch.zeros(len(decodes), max_blocks, dtype=torch.long)
        for i, s in enumerate(decodes):
            table = tables[s.request.request_id][:max_blocks]
            padded[i, : len(table)] = table
        lengths = torch.tensor(ctx)
        mask = None
        if min(ctx) != max_ctx:
            mask = (torch.arange(max_ctx).unsqueeze(0) < lengths.unsqueeze(1)).view(len(decodes), 1, 1, max_ctx)
        return DecodeBatch(len(decodes), padded, lengths, max_ctx, mask)

    def _prefill_segments(self, prefills: list[ScheduledRequest], q_start: int,
                          tables: dict[str, torch.Tensor]) -> list[PrefillSegment]:
        segments = []
        for s in prefills:
            start, n = s.request.num_computed_tokens, s.num_tokens
            ctx = start + n
            table = tables[s.request.request_id][: cdiv(ctx, self.block_size)]
            mask = None
            if start > 0:  # query i (position start+i) sees keys 0..start+i
                mask = torch.arange(ctx).unsqueeze(0) <= (torch.arange(n) + start).unsqueeze(1)
            segments.append(PrefillSegment(q_start, n, table, ctx, mask))
            q_start += n
        return segments
