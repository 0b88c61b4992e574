"""Continuous batching with chunked prefill and preemption by recompute.

Each step has a token budget. Running requests go first (a decode costs one token, an
unfinished prefill takes what is left of the budget); then waiting requests are admitted while
budget, sequence slots, KV blocks and prefill slots (`max_prefill_seqs` requests computing prompt
tokens in a step; a prefill worker's is 1 at serve's defaults) last. When a running request needs a block and none is
free, the most recently admitted running request is preempted: its blocks are freed and it goes
back to the head of the queue to be recomputed (prompt + outputs so far) later.

LoRA adapters: a step serves at most `lora_limit` distinct adapters (the engine's slots,
engine/lora_pool.py); a running request whose adapter has no room this step sits the step out, a
waiting one waits at the head of the queue, so an adapter is never evicted from under a step.

A waiting request whose prefix another worker holds (the cluster index) leaves the queue while
the blocks are pulled on a thread of the tiers (`fetching`); the engine keeps stepping the
others. When the pull ends (all, some or none of the blocks verified), the request rejoins the
queue in its place and is admitted with what arrived; the rest is computed:

    waiting --(remote blocks planned)--> fetching --(pull done, on_fetched wakes the loop)--> waiting --> running
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple

from halfmoon.core.adapters import AdapterRef
from halfmoon.core.blocks import cdiv
from halfmoon.core.params import FinishReason

from halfmoon.engine.request import Request, RequestStatus
from halfmoon.engine.speculative import Speculator
from halfmoon.kvpool.block_hash import block_hashes
from halfmoon.kvpool.block_pool import BlockPool
from halfmoon.kvpool.tiered import KVTiers, Prefetched, TierPlan


@dataclass(slots=True)
class SchedulerStats:
    """Counters since start: prompt tokens computed vs served from the prefix cache, preemptions."""

    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0  # device hits + blocks promoted from host/disk
    prompt_tokens_promoted: int = 0  # of which promoted from host/disk
    preemptions: int = 0
    decode_entries: int = 0  # steps of requests past their prompt (one per request per step)
    decode_tokens: int = 0  # tokens those steps emitted (> entries with speculative decoding)
    decode_single: int = 0  # of those steps, the ones that emitted one token


class ScheduledRequest(NamedTuple):
    request: Request
    num_tokens: int  # tokens computed this step, starting at request.num_computed_tokens
    sample: bool  # this chunk reaches the end of the known tokens: sample the next one
    # speculative verification: drafted tokens computed after the last known one
    # (num_tokens = 1 + len(draft)); the step emits the verified ones (engine/speculative.py)
    draft: tuple[int, ...] = ()


class SchedulerOutput(NamedTuple):
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_num_batched_tokens: int,
                 max_num_seqs: int, tiers: KVTiers | None = None,
                 speculator: Speculator | None = None, max_prefill_seqs: int | None = None) -> None:
        self.pool = pool
        self.speculator = speculator  # drafts for decoding requests, when speculation is on
        self.tiers = tiers  # host/disk tiers below the device prefix cache, if configured
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_prefill_seqs = max_prefill_seqs  # requests computing prompt tokens in one step
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.fetching: dict[str, tuple[Request, Future[Prefetched]]] = {}
        # copies one KV block's contents to another, every layer and rank (set by the engine)
        self.copy_block: Callable[[int, int], None] = _no_copy
        self.on_fetched: Callable[[], None] = lambda: None  # a pull ended (the loop wakes up)
        # the most distinct LoRA adapters one step may use (the engine's slots; 0 = no limit)
        self.lora_limit = 0
        self._step_adapters: set[AdapterRef] = set()
        self.stats = SchedulerStats()

    def add(self, request: Request) -> None:
        """Queue a request in (higher priority, earlier deadline) order; FCFS among equals."""
        self.requests[request.request_id] = request
        key = _order(request)
        if not self.waiting or _order(self.waiting[-1]) <= key:
            self.waiting.append(request)
            return
        for i, other in enumerate(self.waiting):
            if _order(other) > key:
                self.waiting.insert(i, request)
                return

    def add_prefilled(self, request: Request) -> None:
        """A request whose prompt KV already sits in its block table (computed by a prefill
        worker): it runs at once, decoding from its first token; its full prompt blocks join
        the prefix cache like locally computed ones. A table with room beyond the prompt is
        filled before anything is allocated for it; `finish` frees the whole table."""
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)
        self._register_full_blocks(request)

    def fork(self, parent: Request, child: Request) -> None:
        """Start choice `child` of an n > 1 request from `parent`'s computed prompt: it holds a
        reference to each full prompt block (shared, read only) and a copy of the partial last
        block (the next tokens of each choice differ: copy on write, done at once). Its first
        token is already in `child.token_ids`. With no block free for the copy it waits to be
        recomputed like a preempted request (the prompt's full blocks are a prefix-cache hit)."""
        prompt, bs = parent.num_prompt_tokens, self.block_size
        full = prompt // bs
        self.requests[child.request_id] = child
        child.arrival_time, child.scheduled_time = parent.arrival_time, parent.scheduled_time
        child.num_cached_tokens, child.cache_kv = parent.num_cached_tokens, parent.cache_kv
        child.root_hash = parent.root_hash
        if prompt % bs and not self.pool.can_allocate(1):
            self.stats.preemptions += 1
            child.num_preemptions += 1
            child.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(child)
            return
        shared = parent.block_table[:full]
        self.pool.incref(shared)
        child.block_table = list(shared)
        if prompt % bs:
            [copy] = self.pool.allocate(1)
            self.copy_block(parent.block_table[full], copy)
            child.block_table.append(copy)
        child.block_hashes = parent.block_hashes[:full]
        child.num_registered_blocks = min(parent.num_registered_blocks, full)
        child.num_computed_tokens = prompt
        child.status = RequestStatus.RUNNING
        self.running.append(child)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.fetching)

    def only_fetching(self) -> bool:
        """Nothing to compute until a pull ends (the loop may sleep until `on_fetched`)."""
        return (bool(self.fetching) and not self.waiting and not self.running
                and not any(future.done() for _, future in self.fetching.values()))

    def schedule(self) -> SchedulerOutput:
        self._collect_fetches()
        batch: list[ScheduledRequest] = []
        preempted: list[Request] = []
        self._step_adapters.clear()
        budget = self._schedule_running(batch, preempted, self.max_num_batched_tokens)
        if not preempted:  # under memory pressure, admit nobody new this step
            self._schedule_waiting(batch, budget)
        return SchedulerOutput(batch, preempted)

    def _schedule_running(self, batch: list[ScheduledRequest], preempted: list[Request],
                          budget: int) -> int:
        drafts = self.speculator.drafts(self.running, budget) if self.speculator is not None else {}
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if not self._adapter_fits(req):  # its adapter waits for a step with a free slot
                i += 1
                continue
            draft = drafts.get(req.request_id, ())[: max(0, budget - 1)]
            n = min(req.num_tokens - req.num_computed_tokens + len(draft), budget)
            if not self._reserve_or_preempt(req, n, preempted):
                break  # req itself was preempted (it was the last running request)
            batch.append(ScheduledRequest(req, n, True, draft) if draft else self._entry(req, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, batch: list[ScheduledRequest], budget: int) -> None:
        prefills = sum(s.request.num_computed_tokens < s.request.num_prompt_tokens for s in batch)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and (
                self.max_prefill_seqs is None or prefills < self.max_prefill_seqs):
            req = self.waiting[0]
            if not self._adapter_fits(req):
                break
            usable, hit = self._device_hit(req)
            # Touching a cached-but-free block takes it out of the free list too.
            free = self.pool.num_free() - self.pool.num_free_among(hit)
            # Blocks from host/disk/remote only move this step's window later, never needing
            # fewer new blocks: check the device-only need first, so a head request that cannot
            # fit costs no tier or index lookups while it waits.
            if free < self._table_blocks(req, len(hit), budget) - len(hit):
                break
            plan = self._plan(req, usable, len(hit))
            if plan.remote and plan.rows is None:  # pull them off the engine thread; admit later
                self.waiting.popleft()
                self._fetch(req, usable, len(hit) + plan.lower, plan)
                continue
            need = self._table_blocks(req, len(hit) + plan.total, budget) - len(hit)
            if free < need:
                break
            self.waiting.popleft()
            self._admit(req, hit, need, plan)
            # Fewer blocks may have arrived than matched (a corrupt one): the allocation made
            # for `cached + n` still covers `num_computed + n` since num_computed <= cached.
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            batch.append(self._entry(req, n))
            budget -= n
            prefills += 1

    def _adapter_fits(self, req: Request) -> bool:
        """Whether `req` may join this step: the base model, an adapter the step already uses, or
        one more adapter while the step uses fewer than `lora_limit` (it joins the step's set)."""
        adapter = req.params.adapter
        if adapter is None or adapter in self._step_adapters:
            return True
        if self.lora_limit and len(self._step_adapters) >= self.lora_limit:
            return False
        self._step_adapters.add(adapter)
        return True

    def _plan(self, req: Request, usable: list[bytes], device_hit: int) -> TierPlan:
        """Where the blocks past the device hit come from (a finished pull's rows included)."""
        if self.tiers is None:
            return TierPlan(0)
        if req.prefetched is not None:
            return self.tiers.plan_prefetched(usable, device_hit, req.prefetched)
        return self.tiers.plan(usable, device_hit, req.fetch_from)

    def _fetch(self, req: Request, usable: list[bytes], start: int, plan: TierPlan) -> None:
        assert self.tiers is not None and plan.holder is not None
        future = self.tiers.fetch_async(plan.holder, usable[start : start + plan.remote], start)
        req.status = RequestStatus.FETCHING
        self.fetching[req.request_id] = (req, future)
        future.add_done_callback(lambda _: self.on_fetched())

    def _collect_fetches(self) -> None:
        """Requests whose pull ended rejoin the queue, ahead of equals that came after them."""
        for rid, (req, future) in list(self.fetching.items()):
            if not future.done():
                continue
            del self.fetching[rid]
            req.prefetched = future.result()
            req.status = RequestStatus.WAITING
            key = _order(req)
            at = next((i for i, other in enumerate(self.waiting) if _order(other) >= key), len(self.waiting))
            self.waiting.insert(at, req)

    def _table_blocks(self, req: Request, reused_blocks: int, budget: int) -> int:
        """Block-table length after this step when its first `reused_blocks` blocks need no
        compute; never decreases as `reused_blocks` grows."""
        cached = reused_blocks * self.block_size
        return cdiv(cached + min(req.num_tokens - cached, budget), self.block_size)

    def _device_hit(self, req: Request) -> tuple[list[bytes], list[int]]:
        """(hashes of the blocks that may be reused, device blocks holding a prefix of them).

        The last token is always recomputed (its logits are needed), so at most
        (num_tokens - 1) // block_size blocks can hit.
        """
        req.block_hashes = block_hashes(req.token_ids, self.block_size, req.root_hash, req.block_hashes)
        if req.params.prompt_logprobs is not None:  # every prompt row's logits: nothing reused
            return [], []
        usable = req.block_hashes[: (req.num_tokens - 1) // self.block_size]
        return usable, self.pool.get_computed_blocks(usable)

    def _admit(self, req: Request, hit: list[int], need: int, plan: TierPlan) -> None:
        self.pool.touch(hit)
        wanted = req.block_hashes[len(hit) : len(hit) + plan.total]
        pinned = self.tiers.pin(wanted[: plan.lower]) if self.tiers is not None else []
        try:
            new = self.pool.allocate(need)  # may demote other blocks to host/disk: ours are pinned
            loaded = self.tiers.load_plan(plan, wanted, new) if self.tiers is not None else 0
        finally:
            if self.tiers is not None:
                self.tiers.unpin(pinned)
        req.prefetched = None  # used (or outdated): a later admission pulls again if it must
        reused = len(hit) + loaded
        self._register(req, new[:loaded], req.block_hashes[len(hit) : reused])
        req.block_table = hit + new
        req.num_computed_tokens = reused * self.block_size
        req.num_registered_blocks = reused
        self._count_hit(req, loaded)
        if req.scheduled_time is None:
            req.scheduled_time = time.perf_counter()
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _count_hit(self, req: Request, promoted_blocks: int) -> None:
        if req.num_preemptions:  # a recompute after preemption is not a user-visible hit
            return
        req.num_cached_tokens = min(req.num_computed_tokens, req.num_prompt_tokens)
        self.stats.prompt_tokens_cached += req.num_cached_tokens
        self.stats.prompt_tokens_promoted += promoted_blocks * self.block_size

    def _entry(self, req: Request, n: int) -> ScheduledRequest:
        return ScheduledRequest(req, n, req.num_computed_tokens + n == req.num_tokens)

    def _blocks_needed(self, req: Request, n: int) -> int:
        total = cdiv(req.num_computed_tokens + n, self.block_size)
        return max(0, total - len(req.block_table))

    def _reserve_or_preempt(self, req: Request, n: int, preempted: list[Request]) -> bool:
        need = self._blocks_needed(req, n)
        if need == 0:  # its table has room (e.g. a decode reservation of prompt + max_tokens)
            return True
        while not self.pool.can_allocate(need):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        req.block_table.extend(self.pool.allocate(need))
        return True

    def _preempt(self, req: Request) -> None:
        self.pool.free(req.block_table)  # registered blocks stay cached: the recompute may hit them
        req.block_table = []
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0
        req.num_preemptions += 1
        self.stats.preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)

    def update(self, output: SchedulerOutput, sampled: list[list[int]]) -> list[tuple[Request, int]]:
        """Advance computed counts, append sampled tokens (a list per `sample` entry, in order:
        one token, or a verification's accepted drafts and its last token).

        Returns the requests that received tokens this step, with how many.
        """
        got_tokens: list[tuple[Request, int]] = []
        tokens = iter(sampled)
        for req, n, do_sample, draft in output.scheduled:
            self.stats.prompt_tokens_computed += max(0, min(n, req.num_prompt_tokens - req.num_computed_tokens))
            new = next(tokens) if do_sample else []
            if new and req.num_computed_tokens >= req.num_prompt_tokens:  # a decode step
                self.stats.decode_entries += 1
                self.stats.decode_tokens += len(new)
                self.stats.decode_single += len(new) == 1
            # a verification computed 1 + len(draft) inputs; only the verified ones count
            req.num_computed_tokens += n - len(draft) + (len(new) - 1 if draft else 0)
            if draft and self.speculator is not None:
                self.speculator.record(req, len(draft), len(new) - 1)
            req.token_ids.extend(new)
            self._register_full_blocks(req)
            if new:
                got_tokens.append((req, len(new)))
        return got_tokens

    def _register_full_blocks(self, req: Request) -> None:
        """Publish blocks whose every token's KV is now written to the device prefix cache."""
        full = req.num_computed_tokens // self.block_size
        if full <= req.num_registered_blocks or not req.cache_kv:
            return
        req.block_hashes = block_hashes(req.token_ids, self.block_size, req.root_hash, req.block_hashes)
        start = req.num_registered_blocks
        self._register(req, req.block_table[start:full], req.block_hashes[start:full])
        req.num_registered_blocks = full

    def _register(self, req: Request, block_ids: list[int], hashes: list[bytes]) -> None:
        """Device prefix cache first, then the cluster index (if any) hears about them."""
        self.pool.cache_blocks(block_ids, hashes)
        if self.tiers is not None and hashes:
            self.tiers.published(hashes)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Finish a request (any state) and return its blocks to the pool."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        elif req.status is RequestStatus.FETCHING:
            del self.fetching[req.request_id]  # the pull finishes on its thread, unused
        else:
            return
        self.pool.free(req.block_table)
        req.block_table = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]


def _no_copy(src: int, dst: int) -> None:
    raise RuntimeError("Scheduler.copy_block is not set: the engine sets it to copy KV blocks")


def _order(request: Request) -> tuple[int, float]:
    """Where a waiting request stands: higher priority first, then earlier deadline."""
    return (-request.priority, request.deadline)
