"""Turns a scheduled batch into model inputs, runs the model, samples.

Flat layout of a step (decodes first so they share one batched attention call):

    | d_0 | d_1 | ... | d_{B-1} | prefill chunk 0 ...... | prefill chunk 1 .. |

A step's integer inputs (token ids, positions, KV slots, decode block tables and context lengths,
logits rows) are filled into persistent host buffers (`StepBuffers`), never built as new tensors
token by token; an all-decode step (the common one) fills them in one Python pass over the batch.
The decode block tables remember which table each row holds and only append the blocks it
gained, so a steady decode batch copies no block table at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from halfmoon.core.blocks import cdiv
from halfmoon.engine.grammar import step_bitmask
from halfmoon.engine.cuda_graphs import DecodeGraphs, VerifyGraphs, VerifyShape
from halfmoon.engine.lora_pool import LoraPool, LoraStep
from halfmoon.engine.model import LayerHook, DecoderModel
from halfmoon.engine.request import Request
from halfmoon.engine.logits import process, record_logprobs, record_prompt_logprobs, row_spans
from halfmoon.engine.sampler import sample
from halfmoon.engine.speculative import verify
from halfmoon.engine.scheduler import ScheduledRequest
from halfmoon.kernels.attention import AttentionMetadata, DecodeBatch, PrefillSegment


class StepInputs:
    __slots__ = ("input_ids", "positions", "meta", "logits_rows", "sampled", "rope_lens", "drafts", "verify",
                 "prompt_rows", "lora")

    def __init__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 logits_rows: torch.Tensor, sampled: list[Request],
                 rope_lens: torch.Tensor | None = None,
                 drafts: list[tuple[int, ...]] | None = None, verify: VerifyShape | None = None) -> None:
        self.input_ids = input_ids
        self.positions = positions
        self.meta = meta
        # one row per sampled request, or 1 + len(draft) consecutive rows for a verification
        self.logits_rows = logits_rows
        self.sampled = sampled
        self.drafts = drafts  # per sampled request, its draft (None: no verification this step)
        # a verification step's decode rows and contexts on the host (the graphs' bucket choice)
        self.verify = verify
        # dynamic NTK RoPE only: the sequence length each token's frequencies are for
        self.rope_lens = rope_lens
        # prompt logprobs: (request, first position, rows) of the chunks that asked, their logits
        # rows appended after the sampled ones (engine/logits.py record_prompt_logprobs)
        self.prompt_rows: list[tuple[Request, int, int]] = []
        self.lora: LoraStep | None = None  # the rows' LoRA adapters, when any has one


class StepBuffers:
    """Host int64 buffers reused by every step; they grow (never shrink) to the largest step.

    Each buffer is a CPU tensor with a numpy view over the same memory (numpy fills from Python
    lists faster than torch builds tensors). `device` is where the model runs: on CPU a step's
    inputs are views of these buffers; elsewhere they are copied there once per step.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._tensors: dict[str, torch.Tensor] = {}
        self._arrays: dict[str, np.ndarray] = {}
        # Decode block tables: row i holds the first `_row_len[i]` entries of the list object
        # `_row_table[i]` (a request's `block_table`). The scheduler only ever appends to a table
        # or replaces the list (admission, preemption, a prefilled request), so the same object
        # means those entries are still right. Entries past them are stale block ids: valid
        # indices, never read past a request's ctx_len.
        self._row_table: list[list[int] | None] = []
        self._row_len: list[int] = []

    def array(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The numpy view of buffer `name`, grown to at least `shape` (contents kept on growth)."""
        arr = self._arrays.get(name)
        if arr is None or any(have < want for have, want in zip(arr.shape, shape)):
            grown = tuple(max(want, 2 * have if arr is not None else want)
                          for have, want in zip(arr.shape if arr is not None else shape, shape))
            tensor = torch.zeros(grown, dtype=torch.int64, device="cpu")
            new = tensor.numpy()
            if arr is not None:
                new[tuple(slice(0, n) for n in arr.shape)] = arr
            self._tensors[name], self._arrays[name] = tensor, new
            arr = new
        return arr

    def tensor(self, name: str, *sizes: int) -> torch.Tensor:
        """The first `sizes` of buffer `name` as a tensor on the model's device."""
        view = self._tensors[name][tuple(slice(0, n) for n in sizes)]
        return view if self.device.type == "cpu" else view.to(self.device)

    def fill(self, name: str, values: list[int]) -> torch.Tensor:
        self.array(name, (len(values),))[: len(values)] = values
        return self.tensor(name, len(values))

    def decode_tables(self, requests: Sequence[Request], max_blocks: int) -> torch.Tensor:
        """[len(requests), max_blocks] block tables: rows whose request is unchanged only get the
        blocks appended since the last step."""
        rows = self.array("tables", (len(requests), max_blocks))
        if len(self._row_table) < rows.shape[0]:
            grow = rows.shape[0] - len(self._row_table)
            self._row_table += [None] * grow
            self._row_len += [0] * grow
        for i, req in enumerate(requests):
            table = req.block_table
            n = min(len(table), rows.shape[1])
            start = self._row_len[i] if self._row_table[i] is table else 0
            if start < n:
                rows[i, start:n] = table[start:n]
            self._row_table[i], self._row_len[i] = table, max(n, start)
        return self.tensor("tables", len(requests), max_blocks)


class ModelRunner:
    def __init__(self, model: DecoderModel, kv_cache: torch.Tensor, block_size: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self._offsets = torch.arange(block_size)
        self.layer_hook: LayerHook | None = None
        self.buffers = StepBuffers(kv_cache.device)
        self.last_forward_s = 0.0  # wall time of the last step's forward pass (for the profiler)
        self.last_rows = 0  # tokens that forward pass computed (speculation's cost table)
        # tensor parallel (engine/tp_ranks.py): hands each step's inputs to the other ranks
        self.step_sync: Callable[[StepInputs], None] | None = None
        # decode and speculative verification CUDA graphs (engine/cuda_graphs.py), set by the
        # engine when captured
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None
        # what min_tokens holds back (EOS and the model's other stop ids; set by the engine)
        self.stop_ids: frozenset[int] = frozenset()
        self._mask_thread: ThreadPoolExecutor | None = None  # constraints' masks (started on first use)
        self.lora: LoraPool | None = None  # the engine's LoRA slots (None: no adapters served)

    def run(self, scheduled: Sequence[ScheduledRequest]) -> list[list[int]]:
        """One forward pass over the batch; returns the new tokens of each request whose
        `sample` is set: one, or a verification's accepted drafts and its last token."""
        inputs = self.prepare(scheduled)
        if self.step_sync is not None:
            self.step_sync(inputs)
        forks = _forking(inputs)  # n > 1: the other choices sample their first tokens from the same rows
        sampling = _with_forks(inputs, forks) if forks else inputs
        masks = self._masks(sampling)  # constraints: the step's bitmask, computed during the forward
        start = time.perf_counter()
        logits = self._forward(inputs)
        self.last_forward_s = time.perf_counter() - start
        self.last_rows = inputs.meta.num_tokens
        if inputs.prompt_rows:
            sampled_rows = len(inputs.logits_rows) - sum(n for _, _, n in inputs.prompt_rows)
            record_prompt_logprobs(logits[sampled_rows:], inputs.prompt_rows)
            logits = logits[:sampled_rows]
        if not inputs.sampled:
            return []
        bitmask = masks.result() if masks is not None else None
        if forks:
            return self._sample_forks(logits, sampling, forks, bitmask)
        return self._sample_processed(logits, inputs, bitmask)

    def _masks(self, inputs: StepInputs) -> Future[torch.Tensor | None] | None:
        """The constrained requests' bitmask (engine/grammar.py), on the mask thread while this
        one runs the forward pass; None when no sampled request is constrained."""
        if all(r.grammar is None for r in inputs.sampled):
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        spans = row_spans(inputs.drafts, len(inputs.sampled))
        return self._mask_thread.submit(step_bitmask, inputs.sampled, inputs.drafts, spans, self.model.cfg.vocab_size)

    def _sample_processed(self, logits: torch.Tensor, inputs: StepInputs,
                          bitmask: torch.Tensor | None = None) -> list[list[int]]:
        if all(r.params.plain for r in inputs.sampled):
            return self._sample(logits, inputs)
        # biases / penalties / min_tokens / constraints, and logprobs of the raw logits (engine/logits.py)
        emitted = self._sample(process(logits, inputs.sampled, inputs.drafts, self.stop_ids, bitmask), inputs)
        record_logprobs(logits, inputs.sampled, inputs.drafts, emitted)
        return emitted

    def _sample_forks(self, logits: torch.Tensor, extended: StepInputs, forks: list[tuple[int, Request]],
                      bitmask: torch.Tensor | None) -> list[list[int]]:
        """Sample with each forking request's other choices appended as rows of their own (a
        copy of its last prompt row); their first tokens go into their `token_ids`."""
        n = len(extended.sampled) - len(forks)
        rows = [row for row, _ in forks]
        emitted = self._sample_processed(torch.cat([logits, logits[rows]]), extended, bitmask)
        for (_, child), tokens in zip(forks, emitted[n:]):
            child.token_ids.extend(tokens)
        return emitted[:n]

    def _sample(self, logits: torch.Tensor, inputs: StepInputs) -> list[list[int]]:
        if inputs.drafts is None:
            return [[t] for t in sample(logits, inputs.sampled)]
        return self._verify(logits, inputs.sampled, inputs.drafts)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """A graph's replay for a plain decode or verification step that fits one (no layer
        hook, no tensor parallel peers, no dynamic-NTK lengths); else the eager forward."""
        if self.layer_hook is None and self.step_sync is None and inputs.rope_lens is None and inputs.lora is None:
            logits = self._replay(inputs)
            if logits is not None:
                return logits
        return self.model.forward(inputs.input_ids, inputs.positions, self.kv_cache,
                                  inputs.meta, inputs.logits_rows, self.layer_hook, inputs.rope_lens, inputs.lora)

    def _replay(self, inputs: StepInputs) -> torch.Tensor | None:
        """The step's logits from a decode or verification graph; None: no graph holds it."""
        if inputs.drafts is None:
            return None if self.graphs is None else self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        if self.verify_graphs is None or inputs.verify is None:
            return None
        return self.verify_graphs.run(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_rows,
                                      inputs.verify)

    @staticmethod
    def _verify(logits: torch.Tensor, requests: list[Request], drafts: list[tuple[int, ...]]) -> list[list[int]]:
        """Plain rows sampled together; each verification's rows through `verify`."""
        first = [0]
        for d in drafts:
            first.append(first[-1] + 1 + len(d))
        plain = [i for i, d in enumerate(drafts) if not d]
        out: list[list[int]] = [[] for _ in requests]
        if plain:
            tokens = sample(logits[[first[i] for i in plain]], [requests[i] for i in plain])
            for i, t in zip(plain, tokens):
                out[i] = [t]
        for i, d in enumerate(drafts):
            if d:
                out[i] = verify(logits[first[i] : first[i + 1]], d, requests[i])
        return out

    def prepare(self, scheduled: Sequence[ScheduledRequest]) -> StepInputs:
        """Flat inputs in runner order (decodes first); sampled rows in *scheduler* order.

        The scheduler consumes the sampled tokens in its own order, so `logits_rows`/`sampled`
        follow `scheduled`, not the flat layout.
        """
        decodes_only = all(s.num_tokens == 1 and s.sample and not s.draft for s in scheduled)
        flat = _flat_order(scheduled, decodes_only)
        slot_of = None
        if self.lora is not None and any(s.request.params.adapter is not None for s in scheduled):
            slot_of = self.lora.activate_step([s.request.params.adapter for s in flat])
            if decodes_only:  # rows grouped by slot: equal groups need no gather (engine/lora_pool.py)
                flat = sorted(flat, key=lambda s: slot_of.get(s.request.params.adapter, len(slot_of)))
        inputs = self._prepare_decodes(scheduled, flat) if decodes_only else self._prepare_mixed(scheduled)
        if slot_of is not None:
            assert self.lora is not None
            inputs.lora = self.lora.step([(s.request.params.adapter, s.num_tokens) for s in flat], slot_of)
        if self.model.needs_rope_lens:
            inputs.rope_lens = self._rope_lens(flat, inputs.positions)
        return inputs

    @staticmethod
    def _rope_lens(flat: Sequence[ScheduledRequest], positions: torch.Tensor) -> torch.Tensor:
        """HF's dynamic-NTK sequence length per token (engine/rope.py): a prompt token's is the
        prompt's length, a decoded token's its position + 1; `flat`: the step's entries in flat order."""
        prompt = torch.cat([torch.full((s.num_tokens,), s.request.num_prompt_tokens) for s in flat])
        return torch.maximum(positions.cpu() + 1, prompt)

    def _prepare_decodes(self, scheduled: Sequence[ScheduledRequest],
                         flat: Sequence[ScheduledRequest] | None = None) -> StepInputs:
        """The all-decode step (one token each, every one sampled): one pass over the batch, flat
        order = scheduler order, or `flat` (LoRA rows grouped by slot), the logits rows then
        mapping each scheduled entry to its row. A one-token prompt chunk that samples nothing
        (the budget's last token) takes the general path."""
        bs = self.block_size
        requests = [s.request for s in (flat if flat is not None else scheduled)]
        positions = [r.num_computed_tokens for r in requests]
        ids = [r.token_ids[p] for r, p in zip(requests, positions)]
        slots = [r.block_table[p // bs] * bs + p % bs for r, p in zip(requests, positions)]
        b = len(requests)
        buf = self.buffers
        decode = self._decode_batch(requests, [p + 1 for p in positions])
        meta = AttentionMetadata(slot_mapping=buf.fill("slots", slots), decode=decode, prefills=[], num_tokens=b)
        if flat is None or all(a is b for a, b in zip(flat, scheduled)):
            rows = buf.fill("rows", list(range(b)))
        else:
            at = {id(s): i for i, s in enumerate(flat)}
            rows = buf.fill("rows", [at[id(s)] for s in scheduled])
        return StepInputs(buf.fill("ids", ids), buf.fill("positions", positions), meta, rows,
                          [s.request for s in scheduled])

    def _prepare_mixed(self, scheduled: Sequence[ScheduledRequest]) -> StepInputs:
        # a verification (1 + len(draft) rows of one decoding request) is a multi-row decode entry
        decodes = [s for s in scheduled if s.num_tokens == 1 or s.draft]
        prefills = [s for s in scheduled if s.num_tokens > 1 and not s.draft]
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        last_row: dict[str, int] = {}
        # Each block table becomes a tensor once per step; slots and prefill metadata share it.
        tables = {s.request.request_id: torch.tensor(s.request.block_table) for s in scheduled}
        for s in decodes + prefills:
            start = s.request.num_computed_tokens
            table = tables[s.request.request_id]
            ids.extend(s.request.token_ids[start : start + s.num_tokens - len(s.draft)])
            ids.extend(s.draft)
            positions.append(torch.arange(start, start + s.num_tokens))
            slots.append(self._slots(table, start, start + s.num_tokens))
            last_row[s.request.request_id] = len(ids) - 1
        sampled = [s.request for s in scheduled if s.sample]
        drafts = [s.draft for s in scheduled if s.sample]
        # a verification's logits: every one of its 1 + len(draft) rows
        rows = [row for r, d in zip(sampled, drafts) for row in range(last_row[r.request_id] - len(d),
                                                                      last_row[r.request_id] + 1)]
        decode, verify = None, None
        if decodes:
            ctx = [s.request.num_computed_tokens + s.num_tokens for s in decodes]
            if any(s.draft for s in decodes):
                verify = VerifyShape([s.num_tokens for s in decodes], ctx)
            decode = self._decode_batch([s.request for s in decodes], ctx, verify.q_lens if verify else None)
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            decode=decode,
            # the chunks start after the decode *rows* (a verification has 1 + len(draft) of them)
            prefills=self._prefill_segments(prefills, sum(s.num_tokens for s in decodes), tables),
            num_tokens=len(ids),
        )
        prompt_rows, extra = _prompt_rows([s for s in decodes if not s.draft] + prefills, last_row)
        rows += extra
        inputs = StepInputs(torch.tensor(ids), torch.cat(positions), meta, torch.tensor(rows, dtype=torch.long),
                            sampled, drafts=drafts if any(drafts) else None, verify=verify)
        inputs.prompt_rows = prompt_rows
        return inputs

    def _slots(self, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Cache slots of positions [start, end) for a request's block table."""
        all_slots = (table.unsqueeze(1) * self.block_size + self._offsets).flatten()
        return all_slots[start:end]

    def _decode_batch(self, requests: list[Request], ctx: list[int], q_lens: list[int] | None = None) -> DecodeBatch:
        """`ctx`: each request's keys after this step (its new rows included); `q_lens`: rows per
        request when some verify drafts (None: one each)."""
        max_ctx = max(ctx)
        buf = self.buffers
        tables = buf.decode_tables(requests, cdiv(max_ctx, self.block_size))
        lengths = buf.fill("ctx_lens", ctx)
        if q_lens is not None:  # the backends build their own causal masks per row
            return DecodeBatch(len(requests), tables, lengths, max_ctx, None, q_lens=buf.fill("q_lens", q_lens))
        mask = None
        if min(ctx) != max_ctx:
            mask = (torch.arange(max_ctx, device=lengths.device).unsqueeze(0)
                    < lengths.unsqueeze(1)).view(len(requests), 1, 1, max_ctx)
        return DecodeBatch(len(requests), tables, lengths, max_ctx, mask)

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


def _flat_order(scheduled: Sequence[ScheduledRequest], decodes_only: bool) -> list[ScheduledRequest]:
    """The entries in the step's flat row order: the scheduler's for an all-decode step, else
    decodes (and verifications), then prefill chunks (module docstring)."""
    if decodes_only:
        return list(scheduled)
    return ([s for s in scheduled if s.num_tokens == 1 or s.draft]
            + [s for s in scheduled if s.num_tokens > 1 and not s.draft])


def _with_forks(inputs: StepInputs, forks: list[tuple[int, Request]]) -> StepInputs:
    """The step's sampled requests with the forking choices after them (their rows are copies
    of their parent's last prompt row, appended after the sampled rows)."""
    return StepInputs(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_rows,
                      [*inputs.sampled, *(child for _, child in forks)],
                      drafts=None if inputs.drafts is None else [*inputs.drafts, *([()] * len(forks))])


def _forking(inputs: StepInputs) -> list[tuple[int, Request]]:
    """(logits row, choice) of every choice whose first token this step samples: the other
    choices of requests that finish their prompt now (Request.forks)."""
    sampled = inputs.sampled
    if all(r.forks is None for r in sampled):
        return []
    spans = row_spans(inputs.drafts, len(sampled))
    return [(spans[i][0], child) for i, r in enumerate(sampled)
            if r.forks is not None and r.num_output_tokens == 0 for child in r.forks]


def _prompt_rows(entries: Sequence[ScheduledRequest],
                 last_row: dict[str, int]) -> tuple[list[tuple[Request, int, int]], list[int]]:
    """The prompt chunks (one token ones included: the budget's last) whose request asked for
    prompt logprobs: (request, first position, rows) and their flat rows. The row at position p
    predicts prompt token p + 1, so a chunk of positions [start, start + n) gives the rows
    before the prompt's last token; a decoding entry gives none."""
    out: list[tuple[Request, int, int]] = []
    rows: list[int] = []
    for s in entries:
        req = s.request
        if req.params.prompt_logprobs is None:
            continue
        start = req.num_computed_tokens
        count = min(start + s.num_tokens, req.num_prompt_tokens - 1) - start
        if count <= 0:
            continue
        first = last_row[req.request_id] - s.num_tokens + 1
        out.append((req, start, count))
        rows.extend(range(first, first + count))
    return out, rows
