"""The co-located engine: one model, one paged KV cache, continuous batching.

    outputs = engine.step()   # schedule -> run the model -> postprocess

`add_request` and `abort` may be called from other threads: they validate on the caller's
thread (so errors reach the caller at once) and hand over through a lock-guarded inbox that
`step()` drains.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Sequence

import torch

from halfmoon.engine.config import EngineConfig
from halfmoon.engine.grammar import Grammars
from halfmoon.core.blocks import cdiv, first_visible_block
from halfmoon.core.adapters import AdapterRef
from halfmoon.core.errors import InvalidRequestError
from halfmoon.core.messages import ChoiceEnd, ChoiceStart, EngineInfo, TokenChunk, TokenLogprobs
from halfmoon.engine.kv_push import KVPushes, PushStream
from halfmoon.engine.loader import LoadedWeights, load_weights
from halfmoon.engine.model import DecoderModel
from halfmoon.engine.parallel import plan_shard
from halfmoon.engine.logits import take_logprobs, take_prompt_logprobs
from halfmoon.engine.outputs import CompletionResult, Family, TextState, completion_result, request_end
from halfmoon.core.params import FinishReason
from halfmoon.engine.request import Request, RequestStatus
from halfmoon.engine.request_checks import as_token_ids, check_prefilled_blocks, check_push, check_request
from halfmoon.engine.runner import ModelRunner
from halfmoon.core.params import SamplingParams, check_token_ids
from halfmoon.engine.scheduler import Scheduler
from halfmoon.engine.device import build_step_graphs, check_kv_fits, kv_blocks_with_pad, open_device, place_weights, scope
from halfmoon.engine.draft_model import DraftModelProposer
from halfmoon.engine.speculative import SpeculativeConfig, Speculator
from halfmoon.engine.tp_ranks import Ranks
from halfmoon.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from halfmoon.kernels.attention import get_backend
from halfmoon.kvpool.block_hash import block_hashes, root_hash
from halfmoon.engine.lora import lora_shapes, base_names
from halfmoon.engine.lora_pool import LoraPool
from halfmoon.engine.tier_setup import build_tiers
from halfmoon.kvpool.block_pool import BlockPool
from halfmoon.kvpool.device_tier import DeviceTier
from halfmoon.kvpool.remote import InProcessReader, RemoteBlockReader
from halfmoon.transport.layout import KVLayout

log = logging.getLogger(__name__)


def kv_block_bytes(lw: LoadedWeights, config: EngineConfig, kv_heads: int | None = None) -> int:
    """One block's KV bytes on this rank (`kv_heads`: its KV heads; default the model's)."""
    cfg = lw.config
    itemsize = torch.empty(0, dtype=config.torch_dtype).element_size()
    return cfg.num_layers * 2 * config.block_size * (kv_heads or cfg.num_kv_heads) * cfg.head_dim * itemsize


def load_tokenizer(lw: LoadedWeights) -> Tokenizer:
    if lw.fmt == "hf":
        return Tokenizer.from_hf_folder(lw.path)
    return Tokenizer.from_gguf_reader(lw.gguf_reader)


class Engine:
    def __init__(self, config: EngineConfig, remote: RemoteBlockReader | None = None) -> None:
        """`remote` reads blocks other workers hold (found through `config.redis_url`)."""
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.device = open_device(config)
        weights = place_weights(load_weights(config.model, config.torch_dtype, q4_blocks=config.quantization == "int4"),
                                self.device)
        with scope(self.device):
            self._build(weights, remote)

    def _build(self, weights: LoadedWeights, remote: RemoteBlockReader | None) -> None:
        """Everything past the weights, on the engine's device (factory calls included)."""
        config = self.config
        self.model_config = weights.config
        self.tokenizer = load_tokenizer(weights)
        # EOS, the chat template's turn end, generation_config's other stop ids (Llama 3: <|eot_id|>)
        self.stop_ids = frozenset({*self.tokenizer.stop_ids, *weights.config.stop_ids})
        # constrained decoding (engine/grammar.py): compiled constraints, built on first use
        self.grammars = Grammars(self.tokenizer, weights.config.vocab_size, self.stop_ids)
        self.max_model_len = min(config.max_model_len or weights.config.max_position,
                                 weights.config.max_position)
        shard = plan_shard(weights.config, 0, config.tp, config.quantization)
        num_blocks = config.num_blocks or max(1, int(config.kv_cache_gb * 2**30)
                                              // kv_block_bytes(weights, config, shard.num_kv_heads))
        check_kv_fits(self.device, config.gpu_memory_fraction, weights,
                      kv_blocks_with_pad(num_blocks, config) * kv_block_bytes(weights, config, shard.num_kv_heads))
        # tensor parallel: ranks 1..tp-1 load their shards while this one builds its own
        self.ranks = Ranks.launch(config, num_blocks, weights.config) if config.tp > 1 else None
        try:
            self.model = DecoderModel(weights.config, weights.weights, get_backend(config.attention_backend),
                                      config.torch_dtype, config.quantization, weights.q4, self.max_model_len,
                                      weights.wide, shard, self.ranks.group if self.ranks is not None else None)
            if self.ranks is not None:
                self.ranks.wait_ready()
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            raise
        cfg = weights.config
        self.kv_cache = torch.zeros(cfg.num_layers, 2, kv_blocks_with_pad(num_blocks, config), config.block_size,
                                    shard.num_kv_heads, cfg.head_dim, dtype=config.torch_dtype)
        self.pool = BlockPool(num_blocks)
        self.device_tier = DeviceTier(self.kv_cache, self.pool, self.kv_cache.shape[2] - num_blocks)
        self.tiers = build_tiers(config, [self.kv_cache, *(self.ranks.kv_caches if self.ranks is not None else [])],
                                 self.pool, remote, kv_block_bytes(weights, config))
        spec = SpeculativeConfig.of(config)
        proposer = (DraftModelProposer(spec.draft_model, config, cfg.vocab_size, self.max_model_len)
                    if spec.mode == "draft" else None)
        self.speculator = Speculator(spec, self.max_model_len, proposer=proposer) if spec.enabled else None
        self._drafted = 0.0  # the draft model's seconds counted into the step costs so far
        self.scheduler = Scheduler(self.pool, config.block_size, config.max_num_batched_tokens,
                                   config.max_num_seqs, self.tiers, self.speculator, config.max_prefill_seqs)
        self.runner = ModelRunner(self.model, self.kv_cache, config.block_size)
        # LoRA adapters (engine/lora_pool.py); not with tensor parallelism (the slots are not sharded)
        self.lora = None if config.tp > 1 else LoraPool(
            lora_shapes(cfg, base_names(config.model, weights)), config.max_loras, config.max_lora_rank,
            config.max_cpu_loras, config.torch_dtype, self.kv_cache.device, config.lora_base_check)
        self.runner.lora = self.lora
        self.scheduler.lora_limit = config.max_loras
        self.scheduler.copy_block = self._copy_block
        self.runner.stop_ids = self.stop_ids
        if self.ranks is not None:
            self.runner.step_sync = self.ranks.send_step
        self._text: dict[str, TextState] = {}
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._live_ids: set[str] = set()  # guarded by _lock; an id is live until its final output
        self._families: dict[str, Family] = {}  # n > 1 requests whose choices have not all ended
        self.windows = [cfg.window(i) for i in range(cfg.num_layers)]  # per layer, 0 = full attention
        self.pushes = KVPushes(self.pool, config.block_size, self.windows)  # disaggregation, prefill side
        # decode (and verification) CUDA graphs, captured now; padding rows write the pad block
        # past the pool's
        self.runner.graphs, self.runner.verify_graphs = build_step_graphs(
            config, self.model.forward, self.kv_cache, num_blocks, self.max_model_len, self.windows)

    # ------------------------------------------------------------------ requests in

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams,
                    request_id: str | None = None, cache_salt: str | None = None,
                    kv_push: PushStream | None = None, priority: int = 0,
                    deadline: float = math.inf, fetch_from: str | None = None) -> str:
        """Validate and queue a request; returns its id. Thread-safe.

        `cache_salt` isolates tenants: requests with different salts never share KV blocks.
        `priority`: higher is admitted first when requests wait; then the earlier `deadline` (an
        ordering key on the caller's clock); FCFS among equals.
        `fetch_from`: the worker the router priced a remote prefix from; of the holders with the
        longest match at admission, that one is read.
        `kv_push` makes it a prefill-only request (disaggregation): its KV goes layer by layer
        into the stream's destination blocks, it ends after the first token, and the stream's
        DONE carries that token (see `kv_push.py`; the decode side calls `add_prefilled`).
        """
        prompt_ids = as_token_ids(prompt_ids)
        self.validate(prompt_ids, params)
        if kv_push is not None:
            check_push(len(prompt_ids), len(kv_push.dst_block_ids), self.config.block_size)
        if params.adapter is not None and self.lora is not None:
            self.lora.count_request(params.adapter)
        req = self._new_request(prompt_ids, params, cache_salt)
        req.priority, req.deadline, req.fetch_from = priority, deadline, fetch_from
        if params.n > 1:
            req.forks = [self._new_request(list(prompt_ids), params.choice(i), cache_salt)
                         for i in range(1, params.n)]
        with self._lock:
            req.request_id = request_id = self._claim_id(request_id)
            if kv_push is not None:
                self.pushes.add(request_id, kv_push)
            elif req.forks is not None:  # prefill-only: the choices travel in its DONE
                self._family(req)
            self._inbox.append(req)
        return request_id

    def add_prefilled(self, prompt_ids: Sequence[int], first_token: int, params: SamplingParams,
                      block_ids: Sequence[int], request_id: str | None = None,
                      cache_salt: str | None = None, generator_state: bytes | None = None,
                      first_logprobs: TokenLogprobs | None = None,
                      prompt_logprobs: Sequence[TokenLogprobs] | None = None,
                      choices: Sequence[ChoiceStart] = ()) -> str:
        """Queue a request whose prompt KV is already in `block_ids` (received from a prefill
        worker, reserved with `reserve_blocks`) and whose first token was sampled there; it
        joins the running batch at the next step. The blocks become the request's block table:

            | prompt's blocks (KV received) | room for output tokens (optional) |

        With room for every output token (prompt + max_tokens) it never allocates while it
        decodes; the unused tail goes back to the pool when it ends. An n > 1 request brings
        its other `choices`' first tokens: they fork from its prompt blocks as it joins."""
        prompt_ids = as_token_ids(prompt_ids)
        self.validate(prompt_ids, params)
        check_prefilled_blocks(len(prompt_ids), params.max_tokens, len(block_ids), self.config.block_size)
        if len(choices) != params.n - 1:
            raise InvalidRequestError("choices", f"{len(choices)} choices' first tokens for n = {params.n}")
        if params.adapter is not None and self.lora is not None:
            self.lora.count_request(params.adapter)
        req = self._prefilled(list(prompt_ids), params, cache_salt, ChoiceStart(first_token, generator_state, first_logprobs))
        req.prompt_logprobs = list(prompt_logprobs) if prompt_logprobs is not None else None
        req.block_table = list(block_ids)
        req.num_computed_tokens = req.num_prompt_tokens
        # sliding layers' dead blocks were not sent (engine/kv_push.py): not a cacheable prefix
        req.cache_kv = not self.window_truncated(len(prompt_ids))
        if choices:
            req.forks = [self._prefilled(list(prompt_ids), params.choice(i), cache_salt, start)
                         for i, start in enumerate(choices, start=1)]
        with self._lock:
            req.request_id = request_id = self._claim_id(request_id)
            if req.forks is not None:
                self._family(req)
            self._inbox.append(req)
        return request_id

    def _prefilled(self, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None,
                   start: ChoiceStart) -> Request:
        """A request (or choice) that starts from its first token, sampled elsewhere."""
        check_token_ids("first_token", [int(start.first_token)], self.model_config.vocab_size)
        req = self._new_request(prompt_ids, params, cache_salt)
        if start.generator_state is not None:
            req.generator.set_state(torch.frombuffer(bytearray(start.generator_state), dtype=torch.uint8))
        req.token_ids.append(int(start.first_token))
        if params.logprobs is not None:  # the first token's, computed where it was sampled
            req.pending_logprobs = [start.first_logprobs] if start.first_logprobs is not None else None
        return req

    def _family(self, req: Request) -> None:
        """Name the choices of an n > 1 request `{id}#{i}` inside the engine and claim those ids
        (caller holds the lock): chunks carry the request's id and the choice's index."""
        assert req.forks is not None
        ids = [f"{req.request_id}#{i}" for i in range(1, 1 + len(req.forks))]
        taken = self._live_ids.intersection(ids)
        if taken:
            self._live_ids.discard(req.request_id)
            raise InvalidRequestError("request_id", f"{sorted(taken)[0]!r} (a choice's id) is already in use")
        self._live_ids.update(ids)
        req.family = req.request_id
        for i, (child, child_id) in enumerate(zip(req.forks, ids), start=1):
            child.request_id, child.family, child.choice = child_id, req.request_id, i
        self._families[req.request_id] = Family(1 + len(req.forks))

    def info(self) -> EngineInfo:
        """What the Conductor needs to tokenize, hash blocks and size requests like this engine."""
        return EngineInfo(self.max_model_len, self.model_config.vocab_size, self.model_config.fingerprint,
                          self.config.block_size, self.config.kv_tag, self.kv_bytes_per_token,
                          self.model_config.architecture, self.lora.shapes if self.lora is not None else None,
                          self.config.max_lora_rank, self.config.device, socket.gethostname(),
                          len(os.sched_getaffinity(0)), torch.get_num_threads())

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token, all layers, K and V, of every tensor-parallel rank's shard (the
        ranks' shards are the same size): what a tier record, a transfer and the sizing pages
        count per token (rank 0's shard alone would undercount a tp > 1 worker tp-fold)."""
        return self.kv_cache[:, :, 0, 0].numel() * self.kv_cache.element_size() * self.config.tp

    def kv_layout(self) -> KVLayout:
        """What a KV transfer's two ends must agree on: shapes, dtype, model, layer windows, and
        this rank's place in a tensor-parallel engine (its size, its first KV head)."""
        shard = self.model.shard
        return KVLayout.of(self.kv_cache, self.model_config.fingerprint, self.windows, shard.world,
                           shard.kv_heads.start, shard.rank, self.model_config.num_kv_heads)

    def kv_shards(self) -> list[tuple[torch.Tensor, KVLayout]]:
        """Every rank's KV cache and layout, rank 0's first (the ranks' are shared memory:
        engine/tp_ranks.py): the KV transport moves each rank's heads to and from its own."""
        shards = [(self.kv_cache, self.kv_layout())]
        if self.ranks is None:
            return shards
        cfg, mine = self.model_config, self.kv_layout()
        for rank, kv in enumerate(self.ranks.kv_caches, start=1):
            heads = plan_shard(cfg, rank, self.config.tp, self.config.quantization).kv_heads
            shards.append((kv, KVLayout.of(kv, mine.fingerprint, self.windows, self.config.tp, heads.start, rank,
                                           cfg.num_kv_heads)))
        return shards

    def window_truncated(self, prompt_len: int) -> bool:
        """Whether a prefilled prompt of this length arrives without some sliding layer's oldest
        blocks (core.blocks.first_visible_block)."""
        bs = self.config.block_size
        return any(first_visible_block(prompt_len, w, bs) > 0 for w in self.windows)

    def reserve_blocks(self, num_tokens: int) -> list[int]:
        """Blocks for `num_tokens` tokens of KV (decode side: the prompt's, arriving from a
        prefill worker, and room for the output tokens). Call from the thread that runs
        `step()`; hand them to `add_prefilled` or back to `release_blocks`. Raises
        OutOfBlocksError (nothing allocated) when too few are free."""
        return self.pool.allocate(cdiv(num_tokens, self.config.block_size))

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        """Return reserved blocks whose transfer failed or was cancelled (never used)."""
        self.pool.free(block_ids)

    def cached_prefix_tokens(self, prompt_ids: Sequence[int], cache_salt: str | None = None,
                             adapter: AdapterRef | None = None) -> int:
        """Prompt tokens this device's prefix cache holds now (an estimate for admission: the
        blocks may be evicted before the request runs; host/disk tiers are not counted)."""
        bs = self.config.block_size
        root = self._root_hash(len(prompt_ids), cache_salt, adapter)
        usable = list(prompt_ids[: (len(prompt_ids) - 1) // bs * bs])
        return len(self.pool.get_computed_blocks(block_hashes(usable, bs, root))) * bs

    def _new_request(self, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None) -> Request:
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        root = self._root_hash(len(prompt_ids), cache_salt, params.adapter)
        req = Request("", prompt_ids, params, len(prompt_ids), torch.Generator().manual_seed(seed), root_hash=root)
        if params.constraint is not None:  # compiled already when its caller ran Grammars.compile
            req.grammar = self.grammars.state(params.constraint, len(prompt_ids) - params.output_offset)
        return req

    def _root_hash(self, prompt_len: int, cache_salt: str | None, adapter: AdapterRef | None = None) -> bytes:
        """The request's block-hash root. Under dynamic NTK RoPE a prompt longer than the trained
        context is rotated with frequencies of its own length (engine/rope.py): its blocks only
        match prompts of that length, so the length joins the salt."""
        start = self.model.dynamic_from
        if start is not None and prompt_len > start:
            cache_salt = f"{cache_salt or ''}|ntk-len:{prompt_len}"
        return root_hash(self.model_config.fingerprint, self.config.kv_tag, self.config.block_size, cache_salt,
                         adapter.cache_key if adapter is not None else "")

    def _claim_id(self, request_id: str | None) -> str:
        """Reserve a request id that no live request uses (caller holds the lock)."""
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self._live_ids:
                request_id = f"req-{next(self._ids)}"
        elif request_id in self._live_ids:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use by a running request")
        self._live_ids.add(request_id)
        return request_id

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks are freed at the start of the next step. Thread-safe."""
        with self._lock:
            self._aborts.append(request_id)

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise `InvalidRequestError` naming the field when the request cannot run."""
        check_request(as_token_ids(prompt_ids), params, self.model_config.vocab_size, self.max_model_len,
                      self.pool.num_blocks * self.config.block_size)
        if params.adapter is not None:
            self.load_adapter(params.adapter)

    def load_adapter(self, adapter: AdapterRef) -> None:
        """Have `adapter` read and checked in host memory (a no-op when it is): requests naming
        it page it into a slot without touching the disk. InvalidAdapterError when it cannot be
        served; InvalidRequestError on an engine that serves no adapters."""
        if self.lora is None:
            raise InvalidRequestError("model", f"LoRA adapter {adapter.name!r}: adapters are not served "
                                               f"by tensor-parallel engines (tp = {self.config.tp})")
        self.lora.preload(adapter)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks; release the host arena (removed when this engine
        was the last attached) and the disk tier."""
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None
        if self.tiers is None:
            return
        self.tiers.close()
        if self.tiers.host is not None:
            self.tiers.host.release()  # the last engine attached to a node's arena removes it
        if self.tiers.disk is not None:
            self.tiers.disk.close()
        if self.tiers.index is not None:
            if isinstance(self.tiers.remote, InProcessReader):
                self.tiers.remote.unregister(self.tiers.index.holder)
            self.tiers.index.close()
        self.tiers = None
        self.scheduler.tiers = None

    def has_unfinished(self) -> bool:
        with self._lock:
            pending = bool(self._inbox or self._aborts)
        return pending or self.scheduler.has_unfinished()

    def only_fetching(self) -> bool:
        """Nothing to step until a remote pull ends: no new input, every request fetching (the
        loop sleeps until the scheduler's `on_fetched` instead of spinning)."""
        with self._lock:
            pending = bool(self._inbox or self._aborts)
        return not pending and self.scheduler.only_fetching()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[TokenChunk]:
        """Schedule, run one forward pass, postprocess. Returns the per-request progress."""
        with scope(self.device):
            return self._step()

    def _step(self) -> list[TokenChunk]:
        outputs = self._drain_inbox()
        self.pushes.release_sent()
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return outputs
        self.pushes.flush(plan.preempted)
        self.runner.layer_hook = self.pushes.hook(plan.scheduled)
        sampled = self.runner.run(plan.scheduled)
        if self.speculator is not None:  # what the step cost: the target's forward and the drafting
            drafted = getattr(self.speculator.proposer, "seconds", 0.0)
            self.speculator.cost.observe(self.runner.last_rows, self.runner.last_forward_s + drafted - self._drafted)
            self._drafted = drafted
        now = time.perf_counter()
        for req, new in self.scheduler.update(plan, sampled):
            born = self._fork(req) if req.forks is not None and req.request_id not in self.pushes else []
            outputs.append(self._postprocess(req, now, new))
            outputs.extend(self._postprocess(child, now) for child in born)
        outputs.extend(self._abort_failed_pushes(now))
        return outputs

    def _fork(self, req: Request) -> list[Request]:
        """An n > 1 request's prompt is computed and every choice has its first token: the
        other choices start from its blocks (before it may end and free them)."""
        born, req.forks = req.forks or [], None
        for child in born:
            self.scheduler.fork(req, child)
        return born

    def _copy_block(self, src: int, dst: int) -> None:
        """Block `src`'s KV into block `dst`, every layer, on every tensor-parallel rank."""
        for kv in [self.kv_cache, *(self.ranks.kv_caches if self.ranks is not None else [])]:
            kv[:, :, dst].copy_(kv[:, :, src])

    def _drain_inbox(self) -> list[TokenChunk]:
        with self._lock:
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        outputs = []
        for req in new:
            for member in [req, *(req.forks or [])] if req.family is not None else [req]:
                self._text[member.request_id] = TextState(IncrementalDetokenizer(self.tokenizer, keep=req.params.keep_special),
                                                             req.params.stop)
            if req.num_computed_tokens:  # prefilled elsewhere: it brings its first token(s)
                self.scheduler.add_prefilled(req)
                born = self._fork(req) if req.forks is not None else []
                now = time.perf_counter()
                outputs.append(self._postprocess(req, now))
                outputs.extend(self._postprocess(child, now) for child in born)
            else:
                self.scheduler.add(req)
        for request_id in aborts:
            outputs.extend(self._abort(request_id, time.perf_counter()))
        return outputs

    def _abort(self, request_id: str, now: float) -> list[TokenChunk]:
        """End a request (every choice of an n > 1 one, started or not) as aborted."""
        req = self.scheduler.requests.get(request_id)
        members = [] if req is None else [req, *(req.forks or [])]
        family = self._families.get(request_id)
        if family is not None:
            if req is not None:
                req.forks = None  # never started: they end now
            members += [r for i in range(1, family.n) if (r := self.scheduler.requests.get(f"{request_id}#{i}"))]
        outputs = []
        for member in members:
            self._finish(member, FinishReason.ABORT, now)
            outputs.append(self._output(member, [], final=True))
        return outputs

    # ------------------------------------------------------------------ KV push (prefill side)

    def _abort_failed_pushes(self, now: float) -> list[TokenChunk]:
        outputs = []
        for request_id in self.pushes.failed_ids():
            outputs.extend(self._abort(request_id, now))
        return outputs

    # ------------------------------------------------------------------ outputs

    def _postprocess(self, req: Request, now: float, new: int = 1) -> TokenChunk:
        """The request's `new` last tokens, one by one: the first that ends it drops the ones
        after it (a verification may emit several tokens past a stop)."""
        tokens = req.token_ids[-new:]
        del req.token_ids[-new:]
        if req.first_token_time is None:
            req.first_token_time = now
        p = req.params
        for i, token in enumerate(tokens):
            req.token_ids.append(token)
            # before min_tokens outputs no stop string ends it either (vLLM's rule)
            stop_text = self._text[req.request_id].push(token, req.num_output_tokens + p.output_offset >= p.min_tokens)
            reason = self._stop_reason(req, token, stop_text)
            if reason is not None:
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
                req.stop_text = stop_text
                self._finish(req, reason, now)
                return self._output(req, tokens[: i + 1], final=True)
        return self._output(req, tokens, final=False)

    def _stop_reason(self, req: Request, token: int, stop_text: str | None) -> FinishReason | None:
        if self.pushes.failed(req.request_id):  # its KV never reached the decode side
            return FinishReason.ABORT
        p = req.params
        if stop_text is not None or token in p.stop_token_ids:
            return FinishReason.STOP
        if not p.ignore_eos and token in self.stop_ids:
            return FinishReason.STOP
        if req.grammar is not None:
            reason = self._grammar_stop(req)
            if reason is not None:
                return reason
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        if req.request_id in self.pushes:  # prefill-only: decoding continues on the decode side
            return FinishReason.LENGTH
        return None

    @staticmethod
    def _grammar_stop(req: Request) -> FinishReason | None:
        """A constrained request ends when its grammar is complete (EOS was its only next token,
        ignore_eos or not); one whose tokens left the grammar (a bug) is aborted, loudly."""
        state = req.grammar
        state.catch_up(req.token_ids)
        if state.error is not None:
            log.error("request %s: its output left its constraint (%s); aborted", req.request_id, state.error)
            return FinishReason.ABORT
        return FinishReason.STOP if state.complete else None

    def _finish(self, req: Request, reason: FinishReason, now: float) -> None:
        req.finish_time = now
        if self.speculator is not None:
            self.speculator.forget(req.request_id)
        if req.request_id in self.pushes:
            self.pushes.end(req, reason)
        if req.request_id in self.scheduler.requests:
            self.scheduler.finish(req, reason)
        else:  # a choice of an n > 1 request that never started
            req.status, req.finish_reason = RequestStatus.FINISHED, reason

    def _output(self, req: Request, tokens: list[int], final: bool) -> TokenChunk:
        delta = self._text[req.request_id].take(final)
        logprobs, prompt = take_logprobs(req, len(tokens), final), take_prompt_logprobs(req)
        public = req.family if req.family is not None else req.request_id
        if not final:
            return TokenChunk(public, tokens, delta, logprobs=logprobs, prompt_logprobs=prompt, index=req.choice)
        del self._text[req.request_id]
        with self._lock:
            self._live_ids.discard(req.request_id)
        end = request_end(req)
        if req.family is None:
            return TokenChunk(public, tokens, delta, end, logprobs, prompt)
        family = self._families[req.family]
        whole = family.ended(end)
        if whole is not None:
            del self._families[req.family]
        choice = ChoiceEnd(end.finish_reason, end.stop, end.usage.completion_tokens)
        return TokenChunk(public, tokens, delta, whole, logprobs, prompt, req.choice, choice)

    # ------------------------------------------------------------------ offline

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams],
                 cache_salt: str | None = None) -> list[CompletionResult]:
        """Run prompts to completion with continuous batching; results in prompt order."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise InvalidRequestError("params", f"{len(plist)} params for {len(prompts)} prompts")
        prompts = [as_token_ids(ids) for ids in prompts]
        for ids, p in zip(prompts, plist):
            self.validate(ids, p)  # all or nothing: no request starts if one is bad
        order = [self.add_request(ids, p, cache_salt=cache_salt) for ids, p in zip(prompts, plist)]
        chunks: dict[str, list[TokenChunk]] = {rid: [] for rid in order}
        done = 0
        while done < len(order):
            for chunk in self.step():
                chunks[chunk.request_id].append(chunk)
                done += chunk.finished
        return [completion_result(rid, ids, chunks[rid]) for rid, ids in zip(order, prompts)]

    def generate_choices(self, prompt: Sequence[int], params: SamplingParams,
                         cache_salt: str | None = None) -> list[CompletionResult]:
        """Run one prompt of `params.n` choices to completion; one result per choice, in order."""
        prompt = as_token_ids(prompt)
        rid = self.add_request(prompt, params, cache_salt=cache_salt)
        chunks: list[TokenChunk] = []
        while not chunks or not chunks[-1].finished:
            chunks.extend(c for c in self.step() if c.request_id == rid)
        return [completion_result(rid, prompt, chunks, i) for i in range(params.n)]
