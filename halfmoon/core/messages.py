"""Every message that crosses a process seam, and the worker roles' protocols.

```
Conductor                         decode worker                   prefill worker
  DecodeApi.reserve(id, prompt, new, timeout) -> KVHandoff(address, prompt's block_ids)
  PrefillApi.prefill(PrefillTask(..., handoff)) ---------------->  KV units ---> (transport)
                                                 <---- DONE meta: PrefilledKV (transport)
  DecodeApi.generate(DecodeTask) -> TokenChunk ... TokenChunk(end=RequestEnd)
  PrefillResult <-------------------------------------------------  once the decode side verified
  WorkerApi.load() -> WorkerLoad; engine_info() -> EngineInfo; profile() -> Profile;
  check_integrity() -> IntegrityReport (or IntegrityError)
```

`TokenChunk` is the one shape of output tokens from the engine to the front door: the engine
emits it per step, the decode worker streams it, the backends hand it to the APIs. Everything
here is a frozen dataclass (or NamedTuple) of plain values, so it pickles across Ray and compares
in tests. The protocols are what the Conductor calls: a Ray actor handle is adapted to them
(conductor/ray_workers.py), and the worker classes themselves satisfy them in one process.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from halfmoon.core.adapters import AdapterRef, LoraShapes
from halfmoon.core.errors import HalfmoonError, StructuredError
from halfmoon.core.params import FinishReason, SamplingParams

# ---------------------------------------------------------------------- output tokens


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_prompt_tokens: int  # served from the KV cache, not computed
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Timings:
    """Server-side milliseconds: queue, prefill, KV transfer (prefill done -> the decode side
    verified its KV; 0 in one process), time to first token, mean time per output token after
    the first, end to end."""

    queue_ms: float
    prefill_ms: float
    transfer_ms: float
    ttft_ms: float
    mean_tpot_ms: float
    e2e_ms: float


@dataclass(frozen=True, slots=True)
class SloPrediction:
    """What admission predicted for a request, next to its objectives (ms; 0 = no objective)."""

    predicted_ttft_ms: float
    predicted_tbt_ms: float
    ttft_slo_ms: float
    tbt_slo_ms: float


@dataclass(frozen=True, slots=True)
class RequestEnd:
    """How a request ended; carried by its last chunk. `stop`: the stop string that ended it.
    `prediction`: what admission predicted for it (None where nothing was predicted).
    `prefill_worker` / `decode_worker`: where it ran last ("" where nobody said; the co-located
    engine is "engine" for both)."""

    finish_reason: FinishReason
    stop: str | None
    usage: Usage
    timings: Timings
    num_preemptions: int = 0
    prediction: SloPrediction | None = None
    prefill_worker: str = ""
    decode_worker: str = ""
    speculative_proposed: int = 0  # draft tokens verified for it (speculative decoding), and accepted
    speculative_accepted: int = 0


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One generated token's logprob and the `top` most likely tokens (id, logprob), best
    first: log_softmax of the model's raw logits at that position (SamplingParams.logprobs)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_json(self) -> list:
        return [self.logprob, [list(pair) for pair in self.top]]

    @classmethod
    def from_json(cls, value: Sequence) -> TokenLogprobs:
        logprob, top = value
        return cls(float(logprob), tuple((int(i), float(lp)) for i, lp in top))


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """New tokens of one request's choice `index` since its last chunk, and their text; the last
    chunk of a request carries `end`. `logprobs`: one per token, when the request asked for them.

    A request of n > 1 choices (SamplingParams.n) interleaves its choices' chunks; a choice's
    last chunk carries `choice_end`, and the request's very last one also `end` (its usage
    sums every choice's tokens). With n = 1, `end` alone ends the one choice."""

    request_id: str
    token_ids: list[int]
    text: str
    end: RequestEnd | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None
    # a request's first chunk, when it asked: prompt token k+1's logprobs at k (the first has none)
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    index: int = 0
    choice_end: ChoiceEnd | None = None

    @property
    def finished(self) -> bool:
        return self.end is not None

    @property
    def choice_finished(self) -> ChoiceEnd | None:
        """How this chunk's choice ended, if it did (n = 1: from `end`)."""
        if self.choice_end is not None:
            return self.choice_end
        if self.end is None:
            return None
        return ChoiceEnd(self.end.finish_reason, self.end.stop, self.end.usage.completion_tokens)


@dataclass(frozen=True, slots=True)
class ChoiceEnd:
    """How one choice of an n > 1 request ended: why, the stop string, its output tokens."""

    finish_reason: FinishReason
    stop: str | None
    completion_tokens: int


# ---------------------------------------------------------------------- Conductor -> workers


@dataclass(frozen=True, slots=True)
class KVHandoff:
    """Where a request's prompt KV goes: the decode worker's KV receiver and the blocks of the
    prompt there (in block-table order; the reservation's room for the output tokens follows
    them on the decode side and never travels)."""

    address: str
    block_ids: list[int]
    # a tensor-parallel decode worker: every rank's receiver, rank 0's (`address`) first; each
    # rank receives only its KV heads (transport/heads.py). (): one rank, at `address`.
    addresses: tuple[str, ...] = ()

    @property
    def receivers(self) -> tuple[str, ...]:
        """Where each decode rank receives its heads, rank 0's first."""
        return self.addresses or (self.address,)


@dataclass(frozen=True, slots=True)
class PrefillTask:
    """Prefill `prompt_ids` and push their KV into `handoff`. `block_servers`: worker id ->
    where that worker serves its blocks, for prefixes held elsewhere (from the Conductor)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    handoff: KVHandoff
    timeout_s: float = 60.0
    block_servers: Mapping[str, str] = field(default_factory=dict)
    priority: int = 0  # its class's rank: the prefill queue serves higher first
    deadline: float = math.inf  # then earlier deadline first (the Conductor's clock: an order, not a time)
    traceparent: str | None = None  # W3C: the request's span at the Conductor (None: not traced)
    fetch_from: str | None = None  # the holder the router priced a remote prefix from (None: none)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    request_id: str
    first_token: int
    num_cached_tokens: int
    queue_ms: float
    prefill_ms: float
    push_ms: float  # prefill done -> the decode side acknowledged every unit (exposed transfer)


@dataclass(frozen=True, slots=True)
class DecodeTask:
    """Decode a request whose KV arrives in the blocks `reserve` returned for `request_id`.
    `block_servers` as in PrefillTask (a decode worker recomputing a preempted request may
    fetch its prefix)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    timeout_s: float = 60.0
    block_servers: Mapping[str, str] = field(default_factory=dict)
    traceparent: str | None = None  # as in PrefillTask


@dataclass(frozen=True, slots=True)
class PrefilledKV:
    """What travels with the KV, prefill -> decode, besides the blocks (the transport's DONE
    metadata): the first token and, for sampling, the generator state, so seeded sampling
    continues exactly as in one process."""

    first_token: int
    num_cached_tokens: int
    generator_state: bytes | None = None
    first_logprobs: TokenLogprobs | None = None  # the first token's, when the request asked
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # computed by the prefill, when asked
    choices: tuple[ChoiceStart, ...] = ()  # n > 1: choices 1..n-1, sampled from the same logits

    def to_meta(self) -> dict:
        """JSON-able form for the transport's DONE message."""
        meta: dict = {"first_token": self.first_token, "num_cached_tokens": self.num_cached_tokens}
        if self.choices:
            meta["choices"] = [c.to_meta() for c in self.choices]
        if self.generator_state is not None:
            meta["generator_state"] = self.generator_state.hex()
        if self.first_logprobs is not None:
            meta["first_logprobs"] = self.first_logprobs.to_json()
        if self.prompt_logprobs is not None:
            meta["prompt_logprobs"] = [lp.to_json() for lp in self.prompt_logprobs]
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping) -> PrefilledKV:
        state, logprobs, prompt = meta.get("generator_state"), meta.get("first_logprobs"), meta.get("prompt_logprobs")
        return cls(int(meta["first_token"]), int(meta.get("num_cached_tokens", 0)),
                   bytes.fromhex(state) if state else None,
                   TokenLogprobs.from_json(logprobs) if logprobs is not None else None,
                   None if prompt is None else tuple(TokenLogprobs.from_json(v) for v in prompt),
                   tuple(ChoiceStart.from_meta(c) for c in meta.get("choices", ())))


@dataclass(frozen=True, slots=True)
class ChoiceStart:
    """Where choice i > 0 of an n > 1 request starts on the decode side: its first token, its
    generator's state after sampling it, and that token's logprobs (when asked)."""

    first_token: int
    generator_state: bytes | None = None  # None: greedy
    first_logprobs: TokenLogprobs | None = None

    def to_meta(self) -> dict:
        meta: dict = {"first_token": self.first_token}
        if self.generator_state is not None:
            meta["generator_state"] = self.generator_state.hex()
        if self.first_logprobs is not None:
            meta["first_logprobs"] = self.first_logprobs.to_json()
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping) -> ChoiceStart:
        logprobs, state = meta.get("first_logprobs"), meta.get("generator_state")
        return cls(int(meta["first_token"]), bytes.fromhex(state) if state else None,
                   None if logprobs is None else TokenLogprobs.from_json(logprobs))


# ---------------------------------------------------------------------- workers -> Conductor


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's liveness and load (health checks, routing, metrics)."""

    alive: bool
    steps: int
    free_blocks: int
    total_blocks: int
    requests: int
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    blocks_fetched_remote: int = 0
    failure: str | None = None
    pending_tokens: int = 0  # prefill: prompt tokens accepted and not yet prefilled
    reserved: int = 0  # decode: requests holding a KV reservation
    reserved_blocks: int = 0  # decode: the blocks those reservations hold (prompt + output room)
    kv_address: str | None = None  # decode: where its KV receiver listens
    index_heartbeat_max_gap_s: float = 0.0  # its cluster-index holder: longest gap between beats
    index_resyncs: int = 0  # times the index had lost it (expired or Redis restarted) and it re-registered
    running: int = 0  # requests in its engine's running batch now
    host_blocks_used: int = 0  # its host DRAM tier (0 / 0 = none)
    host_blocks_total: int = 0
    disk_blocks_used: int = 0  # its disk tier (0 / 0 = none)
    disk_blocks_total: int = 0
    blocks_from_host: int = 0  # prefix blocks promoted from its host / disk tier, since start
    blocks_from_disk: int = 0
    kv_bytes_received: int = 0  # decode: KV bytes its receiver verified, since start
    kv_bytes_staged: int = 0  # decode: of those, bytes senders sent through staging slots (KV on a GPU)
    blocks_served_remote: int = 0  # blocks its block server sent to other workers, since start
    node_id: str = ""  # the node it runs on, as its cluster-index entries name it
    fetches_in_flight: int = 0  # remote prefix pulls waiting on a holder now
    fetch_failures: int = 0  # remote pulls that failed (holder gone, timeout, corrupt): recomputed
    # LoRA (engine/lora_pool.py): digests of the adapters it holds (slots, then host copies), and
    # its pool's counters since start
    adapters: tuple[str, ...] = ()
    lora: LoraCounters | None = None
    spec_verifications: int = 0  # speculative decoding, since start: verification entries (request x step)
    spec_proposed: int = 0  # draft tokens verified
    spec_accepted: int = 0  # of which accepted
    spec_emitted: int = 0  # tokens verifications emitted (accepted + one each)
    decode_entries: int = 0  # decode steps of its requests since start (a request x a step)
    decode_tokens: int = 0  # tokens they emitted: tokens per decode step = this / decode_entries
    decode_single: int = 0  # of those steps, the ones that emitted a single token
    tp: int = 1  # tensor-parallel size: the worker is one unit of this many ranks (devices)
    kv_rank_bytes: tuple[int, ...] = ()  # decode: KV bytes each rank's receiver verified, rank 0's first


@dataclass(frozen=True, slots=True)
class LoraCounters:
    """A worker's LoRA pool since start (engine/lora_pool.py LoraPoolStats): folders read, slot
    page-ins and evictions, steps that found their adapter resident; requests per adapter name."""

    disk_loads: int = 0
    page_ins: int = 0
    evictions: int = 0
    hits: int = 0
    load_s: float = 0.0
    requests: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the Conductor needs to tokenize, hash blocks and size requests like the workers."""

    max_model_len: int
    vocab_size: int
    fingerprint: str
    block_size: int
    dtype: str  # EngineConfig.kv_tag: the KV dtype, `+int8`/`+int4` for quantized weights
    kv_bytes_per_token: int
    architecture: str = ""  # the model family (engine/families.py), e.g. "llama", "gemma3"
    # what a LoRA adapter must fit (engine/lora.py); None: this engine serves no adapters
    lora: LoraShapes | None = None
    max_lora_rank: int = 0
    # where it computes (the planner's simulator shares CPU cores among the workers of one host):
    # the engine's device, its host's name, the cores this process may run on, its torch threads
    device: str = "cpu"
    host: str = ""
    cores: int = 0
    threads: int = 0


@dataclass(frozen=True, slots=True)
class IntegrityReport:
    """A worker's KV bookkeeping, checked consistent (`WorkerApi.check_integrity`)."""

    worker_id: str
    reservations: int  # decode: requests holding a KV reservation (0 on a prefill worker)
    reserved_blocks: int
    requests: int  # requests in the engine's scheduler (running or waiting)
    free_blocks: int
    total_blocks: int


class PrefillSample(NamedTuple):
    n_new: int
    n_cached: int
    ms: float


class DecodeSample(NamedTuple):
    batch: int
    context_tokens: int
    ms: float


class Profile(NamedTuple):
    """An engine's measured prefill and decode-step times (the Conductor fits its cost model)."""

    prefill: tuple[PrefillSample, ...]
    decode: tuple[DecodeSample, ...]
    kv_bytes_per_token: int
    source: str
    skipped: tuple[str, ...] = ()  # grid points not measured, each with its reason


# ---------------------------------------------------------------------- errors at the seam


class WorkerError(HalfmoonError):
    """A worker could not do what it was asked."""


class WorkerLostError(WorkerError):
    """A worker died (or is restarting) under a request."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(f"worker {worker_id} died under this request; retry")
        self.worker_id = worker_id


class PrefillFailedError(WorkerError):
    """The prefill did not complete (engine failure, abort); nothing reached the decode side."""


class ReservationError(WorkerError):
    """A decode worker refused a KV reservation (e.g. the request id holds one already)."""


class DecodeCapacityError(StructuredError, WorkerError):
    """A decode worker has too few free KV blocks for a reservation (prompt + max new tokens);
    nothing was allocated. The request may succeed later or on another decode worker."""

    requested: int
    free: int
    fields = ("requested", "free")
    template = "the decode worker has {free} free KV blocks; the request needs {requested}"


class IntegrityError(StructuredError, WorkerError):
    """A worker's KV bookkeeping broke an invariant (always a bug): `problems` names each."""

    worker_id: str
    problems: tuple[str, ...]
    fields = ("worker_id", "problems")

    def describe(self) -> str:
        return f"worker {self.worker_id}: KV bookkeeping is inconsistent: " + "; ".join(self.problems)


class DecodeFailedError(WorkerError):
    """The request could not be decoded (the engine failed)."""


class KVTransferFailedError(WorkerError):
    """A request's KV did not reach its decode worker intact (connection lost, timeout,
    checksum mismatch) while both workers lived; both sides gave its blocks back, nothing was
    decoded, so the Conductor may run the request again."""


# ---------------------------------------------------------------------- the worker roles


class WorkerApi(Protocol):
    """What every worker answers."""

    async def load(self) -> WorkerLoad: ...

    async def pid(self) -> int: ...

    async def engine_info(self) -> EngineInfo: ...

    async def profile(self, quick: bool = True) -> Profile: ...

    async def block_address(self) -> str | None: ...

    async def warm_up(self) -> float:
        """One short request through the engine (a standby's kernels warmed); its seconds."""
        ...

    async def check_integrity(self) -> IntegrityReport:
        """Check the worker's KV bookkeeping; raises IntegrityError naming what is broken."""
        ...

    async def load_adapter(self, adapter: AdapterRef) -> None:
        """Read a LoRA adapter into the engine's host cache ahead of its first request; raises
        InvalidAdapterError when this worker cannot read or serve it."""
        ...


class PrefillApi(WorkerApi, Protocol):
    async def prefill(self, task: PrefillTask) -> PrefillResult:
        """Returns once the decode side verified every unit; raises KVTransferFailedError when
        the KV did not arrive intact, PrefillFailedError when the prefill did not complete."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def corrupt_next_push(self, request_id: str | None = None, times: int = 1) -> None:
        """Drill: flip a bit in the next `times` KV units pushed for `request_id`."""
        ...


class DecodeApi(WorkerApi, Protocol):
    async def reserve(self, request_id: str, num_prompt_tokens: int, max_new_tokens: int,
                      timeout_s: float) -> KVHandoff:
        """Reserve every KV block the request can use (prompt + `max_new_tokens`) at once; the
        handoff lists the prompt's. Raises DecodeCapacityError (nothing allocated) when too few
        are free. Released when the request ends, is cancelled, its transfer fails, or its KV
        has not joined the running batch `timeout_s` after this call."""
        ...

    def generate(self, task: DecodeTask) -> AsyncIterator[TokenChunk]:
        """Wait for the KV, then stream the request's tokens (the first one included); raises
        KVTransferFailedError when the KV did not arrive intact."""
        ...

    async def cancel(self, request_id: str) -> None: ...
