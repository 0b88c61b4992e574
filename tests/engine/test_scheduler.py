"""Scheduler on tiny block pools, no model: exact budget split, chunking, preemption, freeing, and
no block leaks after 1000 random requests with random aborts.

The model is replaced by `fake_model_outputs`, a FAKE that returns an arbitrary token id for
every scheduled entry that samples; the scheduler never looks at token values.
"""

from __future__ import annotations

import random
from collections import Counter
from unittest import mock

import pytest
import torch

from halfmoon.core.params import FinishReason

from halfmoon.engine.request import Request, RequestStatus
from halfmoon.core.params import SamplingParams
from halfmoon.engine.scheduler import Scheduler, SchedulerOutput
from halfmoon.kvpool.block_pool import BlockPool

BLOCK_SIZE = 4
VOCAB = 1000

pytestmark = pytest.mark.timeout(60)


def make_request(request_id: str, prompt_len: int, max_tokens: int = 16, shared: bool = False) -> Request:
    """Prompts differ per request id, unless `shared`: then equal lengths share a prefix
    (exercising the device prefix cache)."""
    offset = 0 if shared else sum(map(ord, request_id)) * 31
    prompt = [(7 * i + 3 + offset) % VOCAB for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), prompt_len,
                   torch.Generator().manual_seed(0))


def fake_model_outputs(plan: SchedulerOutput, rng: random.Random) -> list[list[int]]:
    """FAKE model: one arbitrary token per entry whose chunk reaches the end (`sample`)."""
    return [[rng.randrange(VOCAB)] for s in plan.scheduled if s.sample]


def step(sched: Scheduler, rng: random.Random | None = None) -> SchedulerOutput:
    plan = sched.schedule()
    sched.pool.check_integrity()
    sched.update(plan, fake_model_outputs(plan, rng or random.Random(0)))
    sched.pool.check_integrity()
    return plan


def entries(plan: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(s.request.request_id, s.num_tokens, s.sample) for s in plan.scheduled]


# ---------------------------------------------------------------- exact behaviour


def test_budget_is_split_running_first_then_waiting_with_a_partial_chunk() -> None:
    pool = BlockPool(10)
    sched = Scheduler(pool, BLOCK_SIZE, max_num_batched_tokens=10, max_num_seqs=8)
    a, b = make_request("a", 3), make_request("b", 20)
    sched.add(a)
    assert entries(step(sched)) == [("a", 3, True)]
    sched.add(b)
    # a decodes (1 token); b gets the other 9 of the budget, which does not reach its end.
    plan = step(sched)
    assert entries(plan) == [("a", 1, True), ("b", 9, False)]
    assert plan.num_tokens == 10
    assert a.block_table == [0]  # 4 tokens computed: one block
    assert b.block_table == [1, 2, 3]  # 9 tokens: three blocks
    assert (a.num_computed_tokens, b.num_computed_tokens) == (4, 9)
    assert b.num_output_tokens == 0


def test_long_prompt_is_chunked_and_only_the_last_chunk_samples() -> None:
    pool = BlockPool(10)
    sched = Scheduler(pool, BLOCK_SIZE, max_num_batched_tokens=8, max_num_seqs=8)
    req = make_request("long", 25)
    sched.add(req)
    seen = []
    for _ in range(4):
        plan = step(sched)
        seen.append((entries(plan)[0][1:], len(req.block_table)))
    assert seen == [((8, False), 2), ((8, False), 4), ((8, False), 6), ((1, True), 7)]
    assert req.block_table == list(range(7))
    assert req.num_output_tokens == 1
    assert entries(step(sched)) == [("long", 1, True)]  # then decodes


def test_preemption_evicts_the_most_recent_request_and_requeues_it_first() -> None:
    pool = BlockPool(3)
    sched = Scheduler(pool, BLOCK_SIZE, max_num_batched_tokens=64, max_num_seqs=8)
    a, b, c = make_request("a", 4), make_request("b", 8), make_request("c", 2)
    sched.add(a)
    sched.add(b)
    assert entries(step(sched)) == [("a", 4, True), ("b", 8, True)]
    assert (a.block_table, b.block_table) == ([0], [1, 2])
    sched.add(c)
    # a's decode needs a second block and none is free: b (admitted last) is preempted, and
    # nobody new is admitted in a step under memory pressure.
    plan = step(sched)
    assert plan.preempted == [b]
    assert entries(plan) == [("a", 1, True)]
    assert a.block_table == [0, 2]  # b's table was freed tail first, so its block 2 is reused
    assert b.status is RequestStatus.PREEMPTED
    assert (b.block_table, b.num_computed_tokens, b.num_preemptions) == ([], 0, 1)
    assert b.num_tokens == 9  # its sampled token is kept and recomputed with the prompt
    assert list(sched.waiting) == [b, c]
    assert sched.running == [a]
    assert pool.num_free() == 1


def test_preemption_of_the_only_running_request_preempts_itself() -> None:
    pool = BlockPool(2)
    sched = Scheduler(pool, BLOCK_SIZE, max_num_batched_tokens=64, max_num_seqs=8)
    a = make_request("a", 8)
    sched.add(a)
    step(sched)
    assert a.block_table == [0, 1]
    plan = step(sched)  # needs a third block; the pool has two
    assert plan.preempted == [a] and plan.scheduled == []
    assert pool.num_free() == 2


def test_finish_frees_blocks_in_every_state() -> None:
    pool = BlockPool(6)
    sched = Scheduler(pool, BLOCK_SIZE, max_num_batched_tokens=64, max_num_seqs=8)
    running, waiting = make_request("run", 10), make_request("wait", 30)
    sched.add(running)
    step(sched)
    sched.add(waiting)  # 30 tokens need 8 blocks: cannot be admitted next to `run`
    step(sched)
    assert running.block_table == [0, 1, 2] and waiting.status is RequestStatus.WAITING
    sched.finish(running, FinishReason.STOP)
    assert running.status is RequestStatus.FINISHED
    assert running.finish_reason is FinishReason.STOP
    assert running.block_table == []
    assert pool.num_free() == 6
    sched.finish(waiting, FinishReason.ABORT)
    assert waiting.finish_reason is FinishReason.ABORT
    assert sched.requests == {} and not sched.has_unfinished()
    sched.finish(waiting, FinishReason.ABORT)  # finishing twice is a no-op
    pool.check_integrity()
    assert pool.num_free() == 6


def prefilled(pool: BlockPool, request_id: str, prompt_len: int, max_tokens: int, table_blocks: int) -> Request:
    """A request as a decode worker joins it: prompt KV in place, its first token sampled
    elsewhere, `table_blocks` blocks reserved for it."""
    req = make_request(request_id, prompt_len, max_tokens)
    req.block_table = pool.allocate(table_blocks)
    req.token_ids.append(1)
    req.num_computed_tokens = prompt_len
    return req


def test_a_prefilled_request_with_room_for_every_output_never_allocates() -> None:
    """Reserved for prompt + max_tokens (6 + 9 tokens: 4 blocks): it decodes to its last token
    within its table, and finishing frees the tail blocks it never wrote with the rest."""
    pool = BlockPool(6)
    sched = Scheduler(pool, BLOCK_SIZE, max_num_batched_tokens=64, max_num_seqs=8)
    req = prefilled(pool, "roomy", 6, 9, table_blocks=4)
    sched.add_prefilled(req)

    with mock.patch.object(pool, "allocate", wraps=pool.allocate) as allocate:
        for _ in range(8):  # tokens 8..15: the last decode writes token 14's KV, in block 3
            assert entries(step(sched)) == [("roomy", 1, True)]

    assert allocate.call_count == 0
    assert (req.block_table, req.num_tokens, sched.stats.preemptions) == ([0, 1, 2, 3], 15, 0)
    assert pool.num_free() == 2
    sched.finish(req, FinishReason.LENGTH)
    assert pool.num_free() == 6
    pool.check_integrity()


def test_a_prefilled_request_with_its_prompt_s_blocks_only_allocates_as_it_grows() -> None:
    pool = BlockPool(6)
    sched = Scheduler(pool, BLOCK_SIZE, max_num_batched_tokens=64, max_num_seqs=8)
    req = prefilled(pool, "lean", 6, 9, table_blocks=2)
    sched.add_prefilled(req)
    for _ in range(3):  # tokens 8..10; the KV of token 9 needs a third block
        step(sched)
    assert req.block_table == [0, 1, 2]
    sched.finish(req, FinishReason.ABORT)
    assert pool.num_free() == 6


def test_max_num_seqs_caps_admission() -> None:
    pool = BlockPool(10)
    sched = Scheduler(pool, BLOCK_SIZE, max_num_batched_tokens=64, max_num_seqs=2)
    for i in range(3):
        sched.add(make_request(f"r{i}", 2))
    assert entries(step(sched)) == [("r0", 2, True), ("r1", 2, True)]
    assert [r.request_id for r in sched.waiting] == ["r2"]


def test_max_prefill_seqs_steps_one_prompt_at_a_time_beside_the_decodes() -> None:
    """A prefill worker's engine (serve's --prefill-max-seqs 1): one prompt a step, a long one
    chunked alone; requests past their prompt still decode in the same steps."""
    pool = BlockPool(20)
    sched = Scheduler(pool, BLOCK_SIZE, max_num_batched_tokens=8, max_num_seqs=8, max_prefill_seqs=1)
    for name, n in (("a", 3), ("b", 10), ("c", 2)):
        sched.add(make_request(name, n))
    assert entries(step(sched)) == [("a", 3, True)]
    assert entries(step(sched)) == [("a", 1, True), ("b", 7, False)]
    assert entries(step(sched)) == [("a", 1, True), ("b", 3, True)]  # its last chunk: c still waits
    assert entries(step(sched)) == [("a", 1, True), ("b", 1, True), ("c", 2, True)]


def test_admission_waits_for_free_blocks() -> None:
    pool = BlockPool(4)
    sched = Scheduler(pool, BLOCK_SIZE, max_num_batched_tokens=64, max_num_seqs=8)
    a, b = make_request("a", 12), make_request("b", 8)
    sched.add(a)
    sched.add(b)
    assert entries(step(sched)) == [("a", 12, True)]  # b needs 2 blocks, only 1 is free
    sched.finish(a, FinishReason.LENGTH)
    assert entries(step(sched)) == [("b", 8, True)]


# ---------------------------------------------------------------- random soak


def check_plan(sched: Scheduler, plan: SchedulerOutput) -> None:
    ids = [s.request.request_id for s in plan.scheduled]
    assert len(ids) == len(set(ids))
    assert plan.num_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    for s in plan.scheduled:
        assert s.num_tokens >= 1
        end = s.request.num_computed_tokens + s.num_tokens
        assert len(s.request.block_table) * sched.block_size >= end
        assert s.sample == (s.request.num_computed_tokens + s.num_tokens == s.request.num_tokens)


def check_ownership(sched: Scheduler) -> None:
    """Each used block's refcount is exactly the number of live block tables holding it (prefix
    sharing puts one block in several tables); queued requests hold none."""
    held = Counter(b for r in sched.requests.values() for b in r.block_table)
    assert len(held) == sched.pool.num_used()
    assert all(sched.pool.ref_cnt(b) == times for b, times in held.items())
    assert all(r.block_table == [] for r in sched.waiting)
    for r in sched.running:
        assert len(r.block_table) == -(-r.num_computed_tokens // sched.block_size)


def test_no_block_leaks_after_1000_random_requests() -> None:
    rng = random.Random(1234)
    pool = BlockPool(48)  # 192 tokens; one request needs at most 60 + 40
    sched = Scheduler(pool, BLOCK_SIZE, max_num_batched_tokens=32, max_num_seqs=8)
    added, steps = 0, 0
    reasons: Counter[FinishReason] = Counter()
    finished: list[Request] = []
    while added < 1000 or sched.has_unfinished():
        for _ in range(rng.choice([0, 0, 1, 2, 3])):
            if added < 1000:
                sched.add(make_request(f"r{added}", rng.randint(1, 60), rng.randint(1, 40),
                                       shared=rng.random() < 0.5))
                added += 1
        plan = sched.schedule()
        pool.check_integrity()
        check_plan(sched, plan)
        for req, _ in sched.update(plan, fake_model_outputs(plan, rng)):
            if req.num_output_tokens >= req.params.max_tokens:
                reason = FinishReason.LENGTH
            elif rng.random() < 0.02:  # as if it sampled EOS
                reason = FinishReason.STOP
            else:
                continue
            sched.finish(req, reason)
            finished.append(req)
        if sched.requests and rng.random() < 0.05:  # cancel a request in any state
            victim = rng.choice(sorted(sched.requests))
            finished.append(sched.requests[victim])
            sched.finish(sched.requests[victim], FinishReason.ABORT)
        pool.check_integrity()
        check_ownership(sched)
        steps += 1
        assert steps < 50_000, "scheduler stopped making progress"
    assert pool.num_free() == pool.num_blocks
    assert sched.requests == {} and not sched.waiting and not sched.running
    assert len(finished) == 1000
    reasons.update(r.finish_reason for r in finished)
    assert all(reasons[r] > 0 for r in FinishReason)
    assert sum(r.num_preemptions for r in finished) > 0  # the soak did exercise preemption
    assert sched.stats.prompt_tokens_cached > 0  # ... and prefix-cache hits
    assert all(r.block_table == [] and r.status is RequestStatus.FINISHED for r in finished)



def test_priority_orders_the_waiting_queue_fcfs_within_a_priority() -> None:
    sched = Scheduler(BlockPool(64), BLOCK_SIZE, max_num_batched_tokens=4, max_num_seqs=1)
    for rid, priority in [("a", 0), ("b", 0), ("c", 5), ("d", 1), ("e", 5), ("f", -1)]:
        req = make_request(rid, 4)
        req.priority = priority
        sched.add(req)
    assert [r.request_id for r in sched.waiting] == ["c", "e", "d", "a", "b", "f"]
    assert entries(step(sched)) == [("c", 4, True)]  # the highest priority is admitted first
