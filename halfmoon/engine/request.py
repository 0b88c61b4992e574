"""A request's state as the scheduler and runner see it."""

from __future__ import annotations

import enum
import math
import time
from typing import TYPE_CHECKING
from dataclasses import dataclass, field

import torch

from halfmoon.core.messages import TokenLogprobs
from halfmoon.core.params import FinishReason, SamplingParams
from halfmoon.kvpool.tiered import Prefetched

if TYPE_CHECKING:
    from halfmoon.engine.grammar import ConstraintState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    FETCHING = "fetching"  # waiting for its prefix to arrive from another worker
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    """`token_ids` holds the prompt followed by the outputs (one list, appended in place).

    ```
    | prompt (num_prompt_tokens) | outputs ... |
    |<-- num_computed_tokens -->|  (KV in the cache; the rest is computed next)
    ```
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    num_prompt_tokens: int
    generator: torch.Generator
    arrival_time: float = field(default_factory=time.perf_counter)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    priority: int = 0  # higher is admitted first; then earlier deadline; FCFS within both
    deadline: float = math.inf  # an ordering key (the caller's clock), inf = none
    fetch_from: str | None = None  # the worker to read a remote prefix from, if it holds the longest
    prefetched: Prefetched | None = None  # its finished remote pull, until admission uses it
    scheduled_time: float | None = None  # first admitted to the running batch (queue time ends)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    stop_text: str | None = None  # the stop string that ended it, if any
    # Prefix caching: h_0 of this request's tenant (docs/ARCHITECTURE.md, "Block identity"), hashes of its full blocks so far,
    # how many of its block-table entries are registered in the device prefix cache, and how
    # many prompt tokens were served from the cache instead of computed.
    root_hash: bytes = b""
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    spec_proposed: int = 0  # speculative decoding: draft tokens verified for it, and accepted
    spec_accepted: int = 0
    cache_kv: bool = True  # False: its KV is not complete in every layer; never registered or published
    num_cached_tokens: int = 0
    # logit processing and logprobs (engine/logits.py): the penalties' counts (a PenaltyState,
    # built at the first step that needs it) and the logprobs of tokens not yet in a chunk
    penalties: object | None = None
    pending_logprobs: list[TokenLogprobs] | None = None
    # prompt_logprobs: entry k is prompt token k+1's (the first has none); handed to the first chunk
    prompt_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs_sent: bool = False
    # n > 1 (SamplingParams.n): the public request id and this choice's index; choice 0 holds
    # the other choices until its prompt is computed (`forks`: they sample their first tokens
    # from its last prompt row, then share its prompt blocks: Scheduler.fork)
    family: str | None = None
    choice: int = 0
    forks: list[Request] | None = None
    # SamplingParams.constraint: its matcher (engine/grammar.py ConstraintState), caught up with
    # token_ids at each step that samples it
    grammar: ConstraintState | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
