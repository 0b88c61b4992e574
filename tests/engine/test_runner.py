"""The runner's step inputs: the all-decode fast path (persistent buffers, block-table rows kept
between steps) builds exactly what the general path builds, across steps whose batch, tables and
row owners change; a one-token chunk that samples nothing is never sampled."""

from __future__ import annotations

import pytest
import torch

from halfmoon.core.params import SamplingParams
from halfmoon.engine.engine import Engine
from halfmoon.engine.request import Request
from halfmoon.engine.runner import ModelRunner, StepInputs
from halfmoon.engine.scheduler import ScheduledRequest

pytestmark = pytest.mark.timeout(120)


def _request(engine: Engine, rid: str, computed: int, blocks: int) -> Request:
    """A request whose first `computed` tokens have KV, with `blocks` blocks of the pool."""
    tokens = [(11 * i + len(rid)) % 1000 + 16 for i in range(computed + 1)]
    req = Request(rid, tokens, SamplingParams(max_tokens=8), computed + 1, torch.Generator().manual_seed(0))
    req.num_computed_tokens = computed
    req.block_table = engine.pool.allocate(blocks)
    return req


def _same(a: StepInputs, b: StepInputs) -> None:
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.positions, b.positions)
    assert torch.equal(a.meta.slot_mapping, b.meta.slot_mapping)
    assert torch.equal(a.logits_rows, b.logits_rows) and a.sampled == b.sampled
    da, db = a.meta.decode, b.meta.decode
    assert da is not None and db is not None and da.num == db.num and da.max_ctx == db.max_ctx
    assert torch.equal(da.ctx_lens, db.ctx_lens)
    for i, ctx in enumerate(da.ctx_lens.tolist()):  # entries past a request's context are padding
        used = -(-ctx // 16)
        assert torch.equal(da.block_tables[i, :used], db.block_tables[i, :used])
    assert (da.mask is None) == (db.mask is None)
    if da.mask is not None:
        assert torch.equal(da.mask, db.mask)


def test_decode_fast_path_builds_what_the_general_path_builds(engine: Engine) -> None:
    runner = engine.runner
    reference = ModelRunner(engine.model, engine.kv_cache, engine.config.block_size)
    a, b, c = (_request(engine, "a", 40, 3), _request(engine, "b", 15, 1), _request(engine, "c", 70, 5))
    try:
        steps = [[a, b, c], [a, b, c], [c, a], [a, b, c]]
        for i, batch in enumerate(steps):
            scheduled = [ScheduledRequest(r, 1, True) for r in batch]
            _same(runner._prepare_decodes(scheduled), reference._prepare_mixed(scheduled))
            for r in batch:  # one token more each step; b crosses into a new block
                r.token_ids.append(17)
                r.num_computed_tokens += 1
                if r.num_computed_tokens // 16 >= len(r.block_table):
                    r.block_table.extend(engine.pool.allocate(1))
            if i == 1:  # a's table replaced (as a preemption and readmission would)
                engine.pool.free(a.block_table)
                a.block_table = engine.pool.allocate(-(-(a.num_computed_tokens + 1) // 16))
    finally:
        for r in (a, b, c):
            engine.pool.free(r.block_table)


def test_a_one_token_chunk_that_samples_nothing_is_not_sampled(engine: Engine) -> None:
    d, p = _request(engine, "d", 20, 2), _request(engine, "p", 0, 1)
    try:
        inputs = engine.runner.prepare([ScheduledRequest(d, 1, True), ScheduledRequest(p, 1, False)])
        assert inputs.sampled == [d] and inputs.logits_rows.tolist() == [0]
        assert inputs.positions.tolist() == [20, 0]
    finally:
        engine.pool.free(d.block_table)
        engine.pool.free(p.block_table)


def test_a_prefill_beside_a_verification_computes_what_it_computes_alone(engine: Engine) -> None:
    """A verification brings 1 + len(draft) rows; the prefill chunk after it starts at row
    1 + len(draft), not at 1 (one decoding request): placed after the decode *requests*, the chunk
    read the verification's queries as its own and wrote its output over them, so both requests
    got wrong tokens (first seen with a draft model: tests/engine/test_draft_model.py)."""
    d, p = _request(engine, "d", 20, 2), _request(engine, "p", 0, 1)
    p.token_ids = p.token_ids + [40 + i for i in range(11)]  # a 12-token prompt, no KV yet
    verify_d, prefill_p = ScheduledRequest(d, 4, True, (301, 302, 303)), ScheduledRequest(p, 12, True)
    try:
        runner = engine.runner
        mixed = runner.prepare([verify_d, prefill_p])
        assert [(seg.q_start, seg.q_len) for seg in mixed.meta.prefills] == [(4, 12)]
        together = runner._forward(mixed)  # rows: d's 4, then p's last
        alone = torch.cat([runner._forward(runner.prepare([verify_d])), runner._forward(runner.prepare([prefill_p]))])
        assert together.shape == alone.shape == (5, engine.model.cfg.vocab_size)
        # other matmul shapes, other rounding: ~1e-3 apart; a row computed from the wrong queries is far off
        torch.testing.assert_close(together, alone, atol=1e-2, rtol=0)
        assert together.argmax(dim=1).tolist() == alone.argmax(dim=1).tolist()
    finally:
        engine.pool.free(d.block_table)
        engine.pool.free(p.block_table)
