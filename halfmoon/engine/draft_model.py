"""A draft model as speculative decoding's draft source (`--speculative draft:MODEL`).

Any model of a supported family with the target's vocabulary (the same tokenizer) drafts: it
runs in the same engine process with its own paged KV cache, block pool and runner, and keeps a
shadow of each speculating request — the tokens its cache holds KV for. Each step, per request:

    catch up   the tokens the target verified since the last step (one chunk through the draft)
    draft      k greedy tokens, one draft forward each

In the cluster the draft runs on the decode worker: it prefills the prompt itself on the
request's first speculative step (the prefill worker sends only the target's KV).

Drafts are the draft model's argmax, so the verification (engine/speculative.py) is the
coupled one: a draft passes iff it equals the target's own token there, and greedy and seeded
sampled output stay token-identical to decoding without speculation. The draft's KV for
rejected tokens is simply not counted: the next catch-up starts after the longest prefix the
draft computed that the target verified.
"""

from __future__ import annotations

import time

import torch

from halfmoon.core.blocks import cdiv
from halfmoon.core.params import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.errors import UnsupportedModelError
from halfmoon.engine.device import place_weights
from halfmoon.engine.loader import load_config, load_weights
from halfmoon.engine.model import DecoderModel
from halfmoon.engine.request import Request
from halfmoon.engine.runner import ModelRunner
from halfmoon.engine.scheduler import ScheduledRequest
from halfmoon.kernels.attention import get_backend
from halfmoon.kvpool.block_pool import BlockPool
from halfmoon.kvpool.errors import OutOfBlocksError

# Requests whose draft state fits at once (each may grow to max_model_len): beyond, a request
# gets no drafts until one ends.
DRAFT_SLOTS = 8


def _check_vocabulary(model: str, draft_vocab: int, target_vocab: int) -> None:
    if draft_vocab != target_vocab:  # its ids go into the target's embedding, and back
        raise UnsupportedModelError(
            f"draft model {model!r} has a vocabulary of {draft_vocab} tokens, the target {target_vocab}: "
            "a draft model must share the target's tokenizer")


class DraftModelProposer:
    """The `Proposer` of a draft model (module docstring)."""

    def __init__(self, model: str, target: EngineConfig, vocab_size: int, max_model_len: int) -> None:
        _check_vocabulary(model, load_config(model).vocab_size, vocab_size)  # before its weights load
        # on the target's device: the engine builds this inside its device scope
        weights = place_weights(load_weights(model, target.torch_dtype), torch.empty(0).device)
        cfg = weights.config
        self.block_size = target.block_size
        self.max_model_len = max_model_len
        self.model = DecoderModel(cfg, weights.weights, get_backend(target.attention_backend), target.torch_dtype,
                                  max_positions=max_model_len)
        num_blocks = DRAFT_SLOTS * cdiv(max_model_len, self.block_size)
        self.kv_cache = torch.zeros(cfg.num_layers, 2, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                                    dtype=target.torch_dtype)
        self.pool = BlockPool(num_blocks)
        self.runner = ModelRunner(self.model, self.kv_cache, self.block_size)
        self._shadows: dict[str, Request] = {}
        self.seconds = 0.0  # time spent drafting since start (the step cost the policy counts)

    def propose(self, req: Request, k: int) -> list[int]:
        start = time.perf_counter()
        try:
            return self._propose(req, k)
        finally:
            self.seconds += time.perf_counter() - start

    def _propose(self, req: Request, k: int) -> list[int]:
        shadow = self._shadow(req)
        if shadow is None or not self._reserve(shadow, len(req.token_ids) + k):
            return []
        drafts: list[int] = []
        n = len(shadow.token_ids) - shadow.num_computed_tokens  # >= 1: at least the newest token
        for _ in range(k):
            [[token]] = self.runner.run([ScheduledRequest(shadow, n, True)])
            shadow.num_computed_tokens += n
            shadow.token_ids.append(token)
            drafts.append(token)
            n = 1
        return drafts

    def _shadow(self, req: Request) -> Request | None:
        """The request's draft state, its computed tokens cut to what the target verified."""
        shadow = self._shadows.get(req.request_id)
        if shadow is None:
            if len(self._shadows) >= DRAFT_SLOTS:
                return None
            shadow = Request(req.request_id, [], SamplingParams(max_tokens=1), req.num_prompt_tokens,
                             torch.Generator().manual_seed(0))
            self._shadows[req.request_id] = shadow
        valid = _common_prefix(shadow.token_ids, req.token_ids, shadow.num_computed_tokens)
        shadow.token_ids = list(req.token_ids)
        shadow.num_computed_tokens = min(valid, len(req.token_ids) - 1)
        return shadow

    def _reserve(self, shadow: Request, tokens: int) -> bool:
        need = cdiv(tokens, self.block_size) - len(shadow.block_table)
        if need <= 0:
            return True
        try:
            shadow.block_table.extend(self.pool.allocate(need))
        except OutOfBlocksError:
            self.forget(shadow.request_id)
            return False
        return True

    def forget(self, request_id: str) -> None:
        shadow = self._shadows.pop(request_id, None)
        if shadow is not None and shadow.block_table:
            self.pool.free(shadow.block_table)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(limit, len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
