"""CUDA graphs for decode and speculative verification steps: captured per shape bucket at
start-up, replayed each step.

A decode step's shape is (rows, context): an all-decode batch of `n` requests whose longest
context is `max_ctx` tokens runs the graph of the smallest bucket (B, C) with B >= n and
C >= max_ctx. The step's inputs are copied into persistent buffers, rows n..B-1 are padding,
and the graph is replayed; its logits rows [0, n) are the step's:

    rows:  | real 0 .. n-1 | padding n .. B-1 (token 0, position 0, KV slot in the pad block) |
    keys:  | each row's first ctx_i keys (masked from ctx_lens inside the graph) | .. C |

Padding rows write their K/V into one pad block past the pool's blocks (the KV tensor has
`num_blocks + 1` blocks when graphs are on), so they never touch a request's KV.

Why context buckets too: the torch backend gathers each row's blocks up to the step's widest
context, so a graph fixes that width. Buckets double from 256 tokens to the engine's context
limit, or to the smallest sliding window (past a window the backend takes a data-dependent
path that a graph cannot hold).

A speculative verification step (engine/speculative.py: request i brings q_i = 1 + k_i rows,
its last token and k_i drafts) runs the graph of the smallest (R, Q, C) bucket with R >= n
requests, Q >= max q_i rows per request (Q: 1 + k for k = 1, 2, 4, .. and 1 + the most
drafted, `query_buckets`) and C >= max(ctx_i - q_i) + Q. Inside the graph every request has
exactly Q rows (`DecodeBatch.static_q`: the torch backend's multi-query path then needs no
`int(q_lens.max())`, a data-dependent shape), request b's row j at flat row b * Q + j:

    rows:  | req 0: real q_0 rows, padding .. Q | req 1: .. | ... | padding requests n .. R-1 |
    ctx:   request i counts ctx_i - q_i + Q keys: row j < q_i sees keys < ctx_i - q_i + j + 1,
           as eager; its padding rows see a few stale keys of its blocks (read only)

Padding rows and padding requests write their K/V into the pad block (token 0, position 0);
every row's logits are computed into one buffer all verification graphs share (an output per
graph would keep buckets x rows x vocab fp32 alive in the pool) and the real rows' are
gathered back in the eager layout's order, so acceptance (`verify`) is unchanged. Verification graphs exist only when speculation
is configured, for up to MAX_VERIFY_BATCH requests (speculation pays at small batches; the
policy's own crossover, `speculative_max_batch`, lowers it); both kinds are captured at
start-up through one recorder and share its CUDA memory pool. Prefill and mixed steps (a
verification beside a prefill chunk), a layer hook (KV push), dynamic-NTK RoPE, tensor
parallelism, and shapes past the largest bucket run eagerly; `cuda_graphs=False` turns both
kinds off.

The graph object is abstracted (`GraphCapture`): `CudaGraphCapture` records a
torch.cuda.CUDAGraph; the CPU tests drive the bucket, padding and buffer logic through a fake
that replays by calling the function again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import numpy as np
import torch

from halfmoon.core.blocks import cdiv
from halfmoon.kernels.attention import AttentionMetadata, DecodeBatch

log = logging.getLogger(__name__)

MIN_GRAPH_CTX = 256  # the smallest context bucket, in tokens
MAX_GRAPH_BATCH = 256  # the largest batch bucket (vLLM's default capture list ends at 512)
MAX_VERIFY_BATCH = 32  # the most requests a verification graph holds (speculation pays at small batches)


class Captured(Protocol):
    """A recorded step: `replay()` recomputes `output` from the persistent inputs."""

    output: torch.Tensor

    def replay(self) -> None: ...


class GraphCapture(Protocol):
    """Records `fn` (reading and writing only persistent tensors) into a replayable step."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> Captured: ...


class Bucket(NamedTuple):
    rows: int
    ctx: int  # tokens of context the graph's attention covers (a multiple of the block size)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """vLLM's capture sizes up to `max_batch`: 1, 2, 4, then every multiple of 8, and
    `max_batch` itself when it is not one of those."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [b for b in (1, 2, 4) if b <= max_batch] + list(range(8, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return tuple(sizes)


def ctx_buckets(top: int, block_size: int) -> tuple[int, ...]:
    """Context widths up to `top` tokens (a multiple of the block size): MIN_GRAPH_CTX rounded
    to a block, doubling, then `top`."""
    if top < block_size or top % block_size:
        raise ValueError(f"the graphs' context limit {top} is not a positive multiple of the block size {block_size}")
    sizes, c = [], cdiv(MIN_GRAPH_CTX, block_size) * block_size
    while c < top:
        sizes.append(c)
        c *= 2
    sizes.append(top)
    return tuple(sizes)


def pick(sizes: Sequence[int], want: int) -> int | None:
    """The smallest size >= `want` (sizes ascending); None when none is."""
    for s in sizes:
        if s >= want:
            return s
    return None


def graph_ctx_limit(max_model_len: int, windows: Sequence[int], block_size: int) -> int:
    """The widest context a graph covers, in whole blocks: the context limit rounded up, or the
    smallest sliding window rounded down (past a window the backends take a data-dependent
    path). 0: a window under one block, no graphs."""
    top = cdiv(max_model_len, block_size) * block_size
    sliding = [w // block_size * block_size for w in windows if w > 0]
    return min([top, *sliding])


class DecodeGraphs:
    """Persistent decode buffers and one captured graph per bucket.

    `forward(ids, positions, kv_cache, meta, rows)` is the model's forward (logits of `rows`).
    The buffers live on the KV tensor's device; `pad_block` is the block padding rows write to.
    """

    def __init__(self, forward: Callable[..., torch.Tensor], kv_cache: torch.Tensor, pad_block: int,
                 max_batch: int, max_ctx: int, capture: GraphCapture) -> None:
        self.forward = forward
        self.kv_cache = kv_cache
        self.block_size = kv_cache.shape[3]
        self.pad_block = pad_block
        self.rows = batch_buckets(max_batch)
        self.ctxs = ctx_buckets(max_ctx, self.block_size)
        self.capture_with = capture
        dev = kv_cache.device
        b, width = self.rows[-1], self.ctxs[-1] // self.block_size
        self.ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int64, device=dev)
        self.slots = torch.full((b,), pad_block * self.block_size, dtype=torch.int64, device=dev)
        self.tables = torch.full((b, width), pad_block, dtype=torch.int64, device=dev)
        self.ctx_lens = torch.ones(b, dtype=torch.int64, device=dev)
        self.logits_rows = torch.arange(b, dtype=torch.int64, device=dev)
        self.key_pos = torch.arange(self.ctxs[-1], dtype=torch.int64, device=dev)
        self.logits: torch.Tensor | None = None  # [rows, vocab]: every graph's output, set by capture
        self.graphs: dict[Bucket, Captured] = {}
        self.replays = 0  # steps run by a graph
        self.eager = 0  # decode steps that fit no bucket

    def capture(self) -> DecodeGraphs:
        """Record every bucket, widest first (later, smaller graphs reuse its memory pool). One
        eager run of the widest bucket first sizes `logits`, the buffer every graph's logits
        land in (its rows write only the pad block)."""
        with torch.inference_mode():  # as the eager steps run: no autograd state recorded
            for ctx in reversed(self.ctxs):
                for rows in reversed(self.rows):
                    bucket = Bucket(rows, ctx)
                    if self.logits is None:
                        self.logits = torch.empty_like(self._forward(bucket))
                    self.graphs[bucket] = self.capture_with.capture(self._step_fn(bucket))
        return self

    def _forward(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's step over the persistent buffers; the mask is built inside the graph."""
        b, ctx = bucket
        lens = self.ctx_lens[:b]
        mask = (self.key_pos[:ctx].unsqueeze(0) < lens.unsqueeze(1)).view(b, 1, 1, ctx)
        dec = DecodeBatch(b, self.tables[:b, : ctx // self.block_size], lens, ctx, mask)
        meta = AttentionMetadata(slot_mapping=self.slots[:b], decode=dec, prefills=[], num_tokens=b)
        return self.forward(self.ids[:b], self.positions[:b], self.kv_cache, meta, self.logits_rows[:b])

    def _step_fn(self, bucket: Bucket) -> Callable[[], torch.Tensor]:
        """The bucket's forward copied into the shared `logits` buffer: no graph keeps an output
        of its own alive in the memory pool (buckets x rows x vocab fp32: ~3 GB for a 49k
        vocabulary's 9 x 4 buckets), so the pool holds only the widest graph's activations."""
        rows = bucket.rows

        def step() -> torch.Tensor:
            assert self.logits is not None
            return self.logits[:rows].copy_(self._forward(bucket))

        return step

    def bucket_for(self, rows: int, max_ctx: int) -> Bucket | None:
        """The graph a decode step of `rows` requests up to `max_ctx` keys runs; None: eager."""
        b, c = pick(self.rows, rows), pick(self.ctxs, max_ctx)
        return None if b is None or c is None else Bucket(b, c)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Logits [n, vocab] of a plain decode step by replay; None when the step is not one
        a graph holds (the caller runs it eagerly)."""
        dec = meta.decode
        if dec is None or meta.prefills or dec.multi_query or dec.num != meta.num_tokens:
            return None
        n = dec.num
        bucket = self.bucket_for(n, dec.max_ctx)
        if bucket is None or bucket not in self.graphs:
            self.eager += 1
            return None
        self.load(input_ids, positions, meta.slot_mapping, dec, bucket)
        graph = self.graphs[bucket]
        graph.replay()
        self.replays += 1
        return graph.output[:n]

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             dec: DecodeBatch, bucket: Bucket) -> None:
        """Copy a step's n rows into the persistent buffers; rows n..bucket.rows-1 become
        padding (token 0, position 0, one key in the pad block)."""
        n, b = dec.num, bucket.rows
        width = dec.block_tables.shape[1]
        self.ids[:n].copy_(input_ids[:n])
        self.positions[:n].copy_(positions[:n])
        self.slots[:n].copy_(slots[:n])
        self.ctx_lens[:n].copy_(dec.ctx_lens)
        # a row's entries past its table's width are stale block ids, masked by ctx_lens
        self.tables[:n, : min(width, self.tables.shape[1])].copy_(dec.block_tables[:, : self.tables.shape[1]])
        if b > n:
            self.ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slots[n:b].fill_(self.pad_block * self.block_size)
            self.ctx_lens[n:b].fill_(1)
            self.tables[n:b].fill_(self.pad_block)


class VerifyBucket(NamedTuple):
    requests: int
    queries: int  # rows per request: 1 + the most draft tokens the graph verifies
    ctx: int  # as Bucket.ctx, for the requests' keys as if each had `queries` rows


class VerifyShape(NamedTuple):
    """A verification step's shape on the host (the runner's lists, no device read): each
    decoding request's rows (1 + its draft's length) and its keys after the step."""

    q_lens: list[int]
    ctx: list[int]


def query_buckets(max_draft: int) -> tuple[int, ...]:
    """Rows per request a verification graph holds: 1 + k for k = 1, 2, 4, 8 below
    `max_draft`, then 1 + max_draft."""
    if max_draft < 1:
        raise ValueError(f"max_draft must be >= 1, got {max_draft}")
    sizes, k = [], 1
    while k < max_draft:
        sizes.append(1 + k)
        k *= 2
    sizes.append(1 + max_draft)
    return tuple(sizes)


class VerifyGraphs:
    """Persistent buffers and one captured graph per (requests, queries, context) bucket for
    speculative verification steps (module docstring); as `DecodeGraphs` otherwise."""

    def __init__(self, forward: Callable[..., torch.Tensor], kv_cache: torch.Tensor, pad_block: int,
                 max_requests: int, max_draft: int, max_ctx: int, capture: GraphCapture) -> None:
        self.forward = forward
        self.kv_cache = kv_cache
        self.block_size = kv_cache.shape[3]
        self.pad_block = pad_block
        self.requests = batch_buckets(max_requests)
        self.queries = query_buckets(max_draft)
        self.ctxs = ctx_buckets(max_ctx, self.block_size)
        self.capture_with = capture
        dev = kv_cache.device
        r, width = self.requests[-1], self.ctxs[-1] // self.block_size
        rows = r * self.queries[-1]
        self.ids = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.slots = torch.full((rows,), pad_block * self.block_size, dtype=torch.int64, device=dev)
        self.tables = torch.full((r, width), pad_block, dtype=torch.int64, device=dev)
        self.ctx_lens = torch.ones(r, dtype=torch.int64, device=dev)
        self.q_lens = {q: torch.full((r,), q, dtype=torch.int64, device=dev) for q in self.queries}
        self.logits_rows = torch.arange(rows, dtype=torch.int64, device=dev)
        self.logits: torch.Tensor | None = None  # [rows, vocab]: every graph's output, set by capture
        self.graphs: dict[VerifyBucket, Captured] = {}
        self.replays = 0  # verification steps run by a graph
        self.eager = 0  # all-decode verification steps that fit no bucket

    def capture(self) -> VerifyGraphs:
        """Record every bucket, widest first; a bucket's padding requests see `queries` keys of
        the pad block, so each is recorded with the context lengths padding has. One eager run
        of the widest bucket first sizes `logits`, the buffer every graph's logits land in."""
        with torch.inference_mode():
            for ctx in reversed(self.ctxs):
                for q in reversed([q for q in self.queries if q <= ctx]):
                    for r in reversed(self.requests):
                        self.ctx_lens.fill_(q)
                        bucket = VerifyBucket(r, q, ctx)
                        if self.logits is None:
                            self.logits = torch.empty_like(self._forward(bucket))
                        self.graphs[bucket] = self.capture_with.capture(self._step_fn(bucket))
        return self

    def _forward(self, bucket: VerifyBucket) -> torch.Tensor:
        """The bucket's forward: r requests of exactly q rows each (`static_q`: no shape read
        from the device), every row's logits."""
        r, q, ctx = bucket
        rows = r * q
        dec = DecodeBatch(r, self.tables[:r, : ctx // self.block_size], self.ctx_lens[:r], ctx, None,
                          q_lens=self.q_lens[q][:r], static_q=q)
        meta = AttentionMetadata(slot_mapping=self.slots[:rows], decode=dec, prefills=[], num_tokens=rows)
        return self.forward(self.ids[:rows], self.positions[:rows], self.kv_cache, meta, self.logits_rows[:rows])

    def _step_fn(self, bucket: VerifyBucket) -> Callable[[], torch.Tensor]:
        """The bucket's forward copied into the shared `logits` buffer: no graph keeps an
        output of its own alive in the memory pool (buckets x rows x vocab fp32 would add up
        to gigabytes), so the pool holds only the widest graph's activations."""
        rows = bucket.requests * bucket.queries

        def step() -> torch.Tensor:
            assert self.logits is not None
            return self.logits[:rows].copy_(self._forward(bucket))

        return step

    def bucket_for(self, shape: VerifyShape) -> VerifyBucket | None:
        """The graph a verification step of this shape runs; None: eager. Its context covers
        every request's cached keys plus `queries` rows."""
        r, q = pick(self.requests, len(shape.q_lens)), pick(self.queries, max(shape.q_lens))
        if r is None or q is None:
            return None
        c = pick(self.ctxs, max(c - n for c, n in zip(shape.ctx, shape.q_lens)) + q)
        return None if c is None else VerifyBucket(r, q, c)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            logits_rows: torch.Tensor, shape: VerifyShape) -> torch.Tensor | None:
        """Logits of `logits_rows` (flat rows of the eager layout) of an all-decode
        verification step by replay; None when no graph holds it (the caller runs it eagerly)."""
        dec = meta.decode
        if dec is None or meta.prefills or not dec.multi_query or dec.num_rows != meta.num_tokens:
            return None
        bucket = self.bucket_for(shape)
        if bucket is None or bucket not in self.graphs:
            self.eager += 1
            return None
        dest = self.load(input_ids, positions, meta.slot_mapping, dec, shape, bucket)
        graph = self.graphs[bucket]
        graph.replay()
        self.replays += 1
        return graph.output.index_select(0, dest[logits_rows.to(dest.device)])

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             dec: DecodeBatch, shape: VerifyShape, bucket: VerifyBucket) -> torch.Tensor:
        """Copy a step into the persistent buffers, request b's row j to row b * queries + j;
        returns that row of each flat row. The other rows are padding (token 0, position 0,
        KV slot in the pad block); a request's context counts `queries` rows, so its real rows
        keep their keys (ctx - q_len + j + 1); its padding rows read keys of its own blocks (their
        logits are dropped)."""
        n, (r, q, _) = dec.num, bucket
        lens = np.asarray(shape.q_lens, dtype=np.int64)
        starts = np.cumsum(lens) - lens
        dest_np = np.repeat(np.arange(n, dtype=np.int64) * q - starts, lens) + np.arange(int(lens.sum()))
        dest = torch.from_numpy(dest_np).to(self.ids.device)
        rows, pad_slot = r * q, self.pad_block * self.block_size
        for buf, src, fill in ((self.ids, input_ids, 0), (self.positions, positions, 0), (self.slots, slots, pad_slot)):
            buf[:rows].fill_(fill)
            buf.index_copy_(0, dest, src.to(buf.device))
        assert dec.q_lens is not None
        self.ctx_lens[:n].copy_(dec.ctx_lens - dec.q_lens + q)
        self.ctx_lens[n:r].fill_(q)
        width = min(dec.block_tables.shape[1], self.tables.shape[1])
        self.tables[:n, :width].copy_(dec.block_tables[:, :width])
        self.tables[n:r].fill_(self.pad_block)
        return dest


class _CudaGraph:
    __slots__ = ("graph", "output")

    def __init__(self, graph: torch.cuda.CUDAGraph, output: torch.Tensor) -> None:
        self.graph = graph
        self.output = output

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphCapture:
    """torch.cuda.CUDAGraph recording: warm-up runs on a side stream (lazy cuBLAS/allocator
    set-up must not happen inside a capture), then one capture; every graph shares one
    memory pool, so the buckets' activations take the largest one's memory, not the sum."""

    def __init__(self, warmup: int = 2) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.warmup = warmup

    def capture(self, fn: Callable[[], torch.Tensor]) -> Captured:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        return _CudaGraph(graph, output)
