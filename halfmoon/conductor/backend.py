"""The interface between the front door (gRPC / HTTP) and whatever generates tokens.

The API layer validates and tokenizes a request into a `GenerationInput`, then iterates
`backend.generate(input)`: `TokenChunk`s (core.messages) as tokens are sampled; the last one, and
only it, carries the request's `end`.
Closing the iterator early (client cancel, deadline, disconnect) stops the work and frees its KV.
Two backends: the co-located engine (`conductor/colocated.py`) and the disaggregated cluster.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from halfmoon.conductor.admission_stats import AdmissionStats
from halfmoon.core.messages import TokenChunk, WorkerLoad
from halfmoon.core.params import SamplingParams
from halfmoon.core.tracing import NO_SPAN, NO_TRACER, Span, Tracer
from halfmoon.results import ModelInfo
from halfmoon.engine.grammar import Grammars
from halfmoon.engine.tokenizer import Tokenizer

if TYPE_CHECKING:  # conductor.admission imports this module
    from halfmoon.conductor.adapters import AdapterRegistry, LoraStats
    from halfmoon.conductor.planner_loop import PlannerSnapshot
    from halfmoon.core.adapters import AdapterRef
    from halfmoon.conductor.admission import AdmissionConfig
    from halfmoon.conductor.cost_model import CostModel


@dataclass(frozen=True, slots=True)
class Slo:
    """Per-request objectives in milliseconds; None = none asked."""

    ttft_ms: float | None = None
    tbt_ms: float | None = None


@dataclass(frozen=True, slots=True)
class GenerationInput:
    """A validated request, API-neutral. `deadline` is on the `time.monotonic()` clock.
    `priority_class`: the class it named (None = the server's default class); `slo`: objectives
    it set itself, which override its class's. `span`: its span at the front door (the parent of
    what the backend traces; NO_SPAN when not traced)."""

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str | None = None
    cache_salt: str | None = None
    slo: Slo = Slo()
    priority: int = 0
    deadline: float | None = None
    priority_class: str | None = None
    span: Span = NO_SPAN


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the dashboard shows it: what the Conductor tracks about it and its last
    health answer (`load`, None before the first; `at`: when it came, time.monotonic()), and
    the answers before it (rates and hit shares are their differences)."""

    worker_id: str
    role: str  # prefill, decode, colocated
    alive: bool
    restarts: int
    queue_depth: int
    load: WorkerLoad | None
    at: float
    history: tuple[tuple[float, WorkerLoad], ...] = ()  # its recent answers, oldest first (at, load)
    state: str = "ready"  # ready, promoting (a standby just put in service), standby, warming (a spare)
    pid: int = 0  # its process (0: not known)


@dataclass(frozen=True, slots=True)
class BackendStats:
    """A snapshot for `/metrics` and the dashboard."""

    requests_running: int
    requests_waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    engine_steps: int
    # Requests re-run on other workers: before their first token by cause ("worker_lost",
    # "kv_transfer"), after it "migrated" (conductor/migration.py).
    requests_rerun: Mapping[str, int] = field(default_factory=dict)
    queue_depth: Mapping[str, int] = field(default_factory=dict)  # per worker: requests it has pending
    admission: AdmissionStats | None = None  # decisions and prediction errors (conductor/admission.py)
    # Per cluster-index holder: (longest gap between heartbeats in s, re-registrations).
    index_health: Mapping[str, tuple[float, int]] = field(default_factory=dict)
    workers: tuple[WorkerView, ...] = ()
    index_up: bool | None = None  # the Conductor's cluster index reaches its Redis (None: no index)
    index_errors: int = 0  # failed Redis calls of the Conductor's index since start
    tokens_reprefilled: int = 0  # prompt tokens re-sent to prefill by re-runs and moves (conductor/migration.py)
    lora: LoraStats | None = None  # the LoRA adapters served and their traffic (conductor/adapters.py)
    planner: PlannerSnapshot | None = None  # the planner's split, desired split and decisions (None: off)


class GenerationBackend(abc.ABC):
    """What the front door needs from a backend. Async methods run on the server's event loop."""

    model: ModelInfo  # the served model, as the public API describes it
    tokenizer: Tokenizer
    # The priority classes a request may name (conductor/admission.py), and the most tokens
    # (prompt + max_tokens) one request's KV may take where it decodes (None = not known yet).
    priority_classes: frozenset[str] = frozenset({"interactive", "standard", "batch"})
    kv_capacity_tokens: int | None = None
    admission_config: AdmissionConfig  # the policy and the priority classes' objectives
    mode: str = "cluster"  # cluster | colocated (what the dashboard says it is)
    block_size: int = 16  # the workers' KV block, tokens (known once started)
    cost: CostModel | None = None  # the cost model admission prices with (known once started)
    tracer: Tracer = NO_TRACER  # this process's (core/tracing.py); the front door's spans too
    # the LoRA adapters a request's `model` may name (conductor/adapters.py); None: base model only
    adapters: AdapterRegistry | None = None
    _grammars: Grammars | None = None

    @property
    def grammars(self) -> Grammars:
        """The served tokenizer's constraint compiler (engine/grammar.py): the front door checks
        a request's constraint with it before the backend sees the request."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.model.vocab_size)
        return self._grammars

    @abc.abstractmethod
    async def start(self) -> None:
        """Start serving (threads, workers); returns when ready."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop serving: running requests end with `abort`, resources are released."""

    @abc.abstractmethod
    def generate(self, inp: GenerationInput) -> AsyncIterator[TokenChunk]:
        """Stream a request. Raises (before or while streaming) the precise errors of
        `conductor.errors`; closing the iterator early aborts the request and frees its KV."""

    @abc.abstractmethod
    def ready(self) -> bool:
        """True when a request sent now would be served (health checks)."""

    @abc.abstractmethod
    def stats(self) -> BackendStats:
        """Current load, cheap enough to call on every scrape."""

    def degraded(self) -> list[str]:
        """Why serving goes on at less than full strength ([] = it does not): e.g. the cluster
        index's Redis is unreachable, so prefixes are found only in each worker's own cache."""
        return []

    async def prepare_adapter(self, adapter: AdapterRef) -> None:
        """Called once `adapter` is in `adapters` (loaded at start or by the admin API): a
        backend may read it ahead of the first request naming it. Default: nothing (workers read
        it when a request first needs it); raises InvalidAdapterError when it cannot be served."""

    def standbys(self) -> list[dict[str, str]]:
        """The warm standby workers and the ones just promoted from them, for /health: id, role,
        state (standby, warming, promoting; [] = none configured)."""
        return []
