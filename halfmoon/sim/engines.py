"""Simulated workers on a simulated clock: each serves its queue step by step as the real engine's
scheduler does (engine/scheduler.py), each step timed by the cost model.

    prefill worker   steps of up to max_num_batched_tokens prompt tokens, packed as the engine's
                     scheduler packs them (conductor/prefill_steps.py: started prefills first,
                     then the queue in the ledger's order: rank, deadline, admission): a step
                     takes prefill_step(its chunks) + the fetches of the prefills it starts;
                     every prompt finishing in it gets its first token at its end; its KV
                     reaches the decode worker `kv_tail` of a full transfer later (the rest
                     overlapped the prefill layer by layer)
    decode worker    continuous batching: who has KV joins at the next step (up to max_seqs);
                     a step of b requests holding k tokens takes decode_step(b, k); a request's
                     first token ends its first step
    co-located       one engine: decodes first (one token each), then prefill chunks in queue
                     order with what is left of the step's token budget; a step takes
                     decode_step(b, k) + prefill(chunk, done) per chunk; a prefill's last chunk
                     samples its first token, and it decodes from the next step on

Workers sharing cores (`Cores`, SimConfig.cores: CPU workers on one machine) step slower while
more of them step than there are cores: a step (a decode stretch, until the next worker starts
or stops) takes max(1, stepping / cores) x the cost model's time, the processor sharing an OS
gives processes that compute.

Per-request progress is kept as step numbers, not counted per token: a request that joined at
step s has s' - s + 1 tokens after step s', and its token gaps are the durations of steps s+1..
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.dispatch import Booking
from halfmoon.conductor.prefill_steps import PrefillSteps
from halfmoon.sim.tiers import Hits, TieredCache
from halfmoon.sim.workload import SimRequest

KV_TAIL = 0.05  # of a prompt's full KV transfer time not hidden behind its prefill


class Clock:
    """A discrete-event clock: callbacks run in time order (ties: in the order scheduled)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (max(t, self.now), next(self._seq), fn))

    def advance(self, seconds: float) -> None:
        """Move an idle clock on (between replays)."""
        if self._events:
            raise RuntimeError("the clock has events pending: run it first")
        self.now += seconds

    def run(self) -> None:
        while self._events:
            t, _, fn = heapq.heappop(self._events)
            self.now = t
            fn()


@dataclass(slots=True)
class Flight:
    """An admitted request on its way through the simulated workers."""

    request: SimRequest
    booking: Booking
    order: tuple[int, float, int]  # its queue place: (-rank, deadline, arrival seq)
    hits: Hits = Hits(0, 0, 0)
    prefix_tokens: int = 0  # prompt tokens not computed (own cache or fetched)
    done_tokens: int = 0  # prompt tokens computed so far (after its prefix)
    table: list[int] = field(default_factory=list)  # co-located: its blocks in the engine's cache
    join_step: int = -1  # the step that produced its first token
    added_step: int = 0  # the batch's step count when it joined (its context grows from then)

    @property
    def new_tokens(self) -> int:
        return self.request.prompt_len - self.prefix_tokens


class DecodeBatch:
    """The step-number bookkeeping of a continuous batch (module docstring)."""

    def __init__(self, max_seqs: int) -> None:
        self.max_seqs = max_seqs
        self.running: dict[int, Flight] = {}
        self.context = 0  # tokens the running requests hold
        self.steps = 0  # steps ended
        self.durations: list[float] = []  # of each ended step
        self._finishing: list[tuple[int, int]] = []  # heap: (last step, request index)

    def add(self, flight: Flight, step: int) -> None:
        """`flight`'s first token ends `step`: the next step (a decode worker's joiner) or the
        one that just ended (a co-located prefill's last chunk). It decodes in every step after."""
        flight.join_step, flight.added_step = step, self.steps
        self.running[flight.request.index] = flight
        self.context += flight.request.prompt_len + 1
        heapq.heappush(self._finishing, (step + flight.request.output_len - 1, flight.request.index))

    def generated(self, flight: Flight, extra_steps: int = 0) -> int:
        """Tokens `flight` has made once `extra_steps` more steps have ended."""
        return max(0, self.steps + extra_steps - flight.join_step)

    def steps_to_next_finish(self) -> int:
        """Steps until (and including) the next one a request finishes in (1 when none will)."""
        return self._finishing[0][0] - self.steps + 1 if self._finishing else 1

    def end_steps(self, durations: Sequence[float]) -> list[Flight]:
        """Several steps of an unchanged batch, none finishing before the last (a stretch)."""
        head = len(durations) - 1
        if head:
            self.durations.extend(durations[:head])
            self.steps += head
            self.context += head * len(self.running)
        return self.end_step(durations[-1])

    def end_step(self, duration: float) -> list[Flight]:
        """A step of the running batch ended: every request got a token; those done leave."""
        self.durations.append(duration)
        step = self.steps
        self.steps += 1
        done = []
        while self._finishing and self._finishing[0][0] <= step:
            _, index = heapq.heappop(self._finishing)
            flight = self.running.pop(index)
            self.context -= flight.request.prompt_len + 1 + (step - flight.added_step)
            done.append(flight)
        self.context += len(self.running)  # each kept the token it made
        return done

    def tbt_s(self, flight: Flight) -> float | None:
        """Mooncake's TBT of a finished request: the mean of its longest tenth of token gaps."""
        n = flight.request.output_len - 1
        if n <= 0:
            return None
        gaps = sorted(self.durations[flight.join_step + 1: flight.join_step + 1 + n])
        top = gaps[-max(1, n // 10):]
        return sum(top) / len(top)


class Cores:
    """`n` cores the workers share (None: each worker its own device, no sharing): while k
    workers step, each step takes max(1, k / n) x its time (module docstring)."""

    def __init__(self, n: float | None) -> None:
        if n is not None and not n > 0:
            raise ValueError(f"cores must be > 0, got {n}")
        self.n = n
        self._stepping: dict[Worker, None] = {}  # the workers stepping, in the order they started

    def start(self, worker: Worker) -> float:
        """`worker` steps now: its steps' stretch factor (the others' decode stretches end with
        the step they are in, to be timed again with one more sharing)."""
        if self.n is None:
            return 1.0
        if worker not in self._stepping:
            self._stepping[worker] = None
            self._recut(worker)
        return max(1.0, len(self._stepping) / self.n)

    def stop(self, worker: Worker) -> None:
        """`worker` is idle: the others' stretches are timed again with one fewer."""
        if worker in self._stepping:
            del self._stepping[worker]
            self._recut(worker)

    def _recut(self, changed: Worker) -> None:
        for other in self._stepping:
            if other is not changed and isinstance(other, Stepper):
                other.cut()


NO_SHARING = Cores(None)


class Worker:
    """What every simulated worker shares: the clock, the cost model, busy time, the cores."""

    def __init__(self, worker_id: str, cost: CostModel, clock: Clock, cores: Cores = NO_SHARING) -> None:
        self.worker_id = worker_id
        self.cost = cost
        self.clock = clock
        self.cores = cores
        self.busy_s = 0.0


class Stepper(Worker):
    """A worker stepping a decode batch. While nothing joins or finishes, its steps are run as
    one stretch (one event, not one per step: each step's time still from the cost model); what
    arrives meanwhile cuts the stretch at the end of the step in progress, as a real engine
    takes new work at its next step."""

    MAX_STRETCH = 4096

    def __init__(self, worker_id: str, cost: CostModel, clock: Clock, max_seqs: int,
                 cores: Cores = NO_SHARING) -> None:
        super().__init__(worker_id, cost, clock, cores)
        self.batch = DecodeBatch(max_seqs)
        self.stepping = False
        self._ends: list[float] = []  # the stretch's step end times
        self._durations: list[float] = []
        self._generation = 0

    def run_steps(self, durations: list[float], work: Any) -> None:
        """Run the steps; `end(durations, work)` when the last has ended (`work`: what the
        first step carried besides decodes, which makes it a stretch of one)."""
        self.stepping = True
        share = self.cores.start(self)
        self._durations = durations if share == 1.0 else [d * share for d in durations]
        self._ends = list(itertools.accumulate(self._durations, initial=self.clock.now))[1:]
        self._schedule(work)

    def decode_stretch(self) -> list[float]:
        """Step times of the running batch until its next finish (context grows b a step)."""
        b = self.batch
        n, running, d = min(b.steps_to_next_finish(), self.MAX_STRETCH), len(b.running), self.cost
        return [d.est_decode_step_ms(running, b.context + i * running) / 1e3 for i in range(n)]

    def cut(self) -> None:
        """New work arrived: the stretch ends with the step in progress."""
        if self.stepping and len(self._ends) > 1:
            keep = bisect.bisect_left(self._ends, self.clock.now) + 1
            if keep < len(self._ends):
                self._durations, self._ends = self._durations[:keep], self._ends[:keep]
                self._schedule([])

    def steps_done(self) -> int:
        """Steps of the stretch in progress that have ended by now."""
        return bisect.bisect_right(self._ends, self.clock.now) if self.stepping else 0

    def _schedule(self, work: Any) -> None:
        self._generation += 1
        generation, durations = self._generation, self._durations
        self.clock.at(self._ends[-1], lambda: self._ended(generation, durations, work))

    def _ended(self, generation: int, durations: list[float], work: Any) -> None:
        if generation != self._generation:  # cut short: a later event ends it
            return
        self.stepping = False
        self._ends = []
        self.busy_s += sum(durations)
        self.end(durations, work)
        if not self.stepping:
            self.cores.stop(self)

    def end(self, durations: list[float], work: Any) -> None:
        raise NotImplementedError


class AdapterSlots:
    """A worker's LoRA slots as the simulator keeps them: the `size` adapters used last (LRU, as
    engine/lora_pool.py evicts); a request under an adapter not held pays `load_ms` first."""

    def __init__(self, size: int, load_ms: float) -> None:
        self.size, self.load_ms = size, load_ms
        self._held: OrderedDict[str, None] = OrderedDict()
        self.loads = 0
        self.evictions = 0

    def holds(self, adapter: str) -> bool:
        return not adapter or adapter in self._held

    def use(self, adapter: str) -> float:
        """`adapter` made resident (the LRU's newest); the ms its load took (0: it was held)."""
        if not adapter:
            return 0.0
        if adapter in self._held:
            self._held.move_to_end(adapter)
            return 0.0
        if len(self._held) >= self.size:
            self._held.popitem(last=False)
            self.evictions += 1
        self._held[adapter] = None
        self.loads += 1
        return self.load_ms


class PrefillWorker(Worker):
    """A prefill engine: steps of up to `steps.budget` prompt tokens, packed as the real scheduler packs
    them (conductor/prefill_steps.py `pack`: its unfinished prefills first, then the queue in
    order); a step takes `CostModel.est_prefill_step_ms` of its chunks plus the fetches of the
    prefills it starts. An idle worker steps as soon as work arrives (that work alone); work
    submitted while a step runs, a window's later decisions of the same instant too, waits for
    the next (as `PrefillLedger` predicts)."""

    def __init__(self, worker_id: str, cost: CostModel, clock: Clock, cache: TieredCache,
                 kv_tail: float, on_done: Callable[[Flight], None], steps: PrefillSteps,
                 adapters: AdapterSlots | None = None, cores: Cores = NO_SHARING) -> None:
        super().__init__(worker_id, cost, clock, cores)
        self.cache = cache
        self.adapters = adapters or AdapterSlots(4, 0.0)
        self.kv_tail = kv_tail
        self.on_done = on_done
        self.steps = steps  # the engine's budget (and prompts a step); timed by `cost`, not steps.cost
        self._queue: list[tuple[tuple[int, float, int], Flight]] = []
        self._started: list[Flight] = []  # prefills begun and not finished, in the order begun
        self._busy = False

    @property
    def depth(self) -> int:
        return len(self._queue) + len(self._started)

    def submit(self, flight: Flight) -> None:
        heapq.heappush(self._queue, (flight.order, flight))
        if not self._busy:
            self._busy = True
            self._step()

    def _step(self) -> None:
        started = [(f, f.new_tokens - f.done_tokens) for f in self._started]
        waiting = [f for _, f in sorted(self._queue)]
        line = started + [(f, 0) for f in waiting]
        takes = self.steps.pack(left or self._begin_demand(f) for f, left in line)
        chunks: list[tuple[Flight, int]] = []
        fetch_ms = 0.0
        for (flight, left), take in zip(line, takes):
            if not left:  # it starts in this step
                fetch_ms += self._begin(flight)
            chunks.append((flight, take))
        if not chunks:
            self._busy = False
            self.cores.stop(self)
            return
        ms = self.cost.est_prefill_step_ms((take, f.prefix_tokens + f.done_tokens) for f, take in chunks)
        seconds = self.cores.start(self) * (ms + fetch_ms) / 1e3
        self.busy_s += seconds
        self.clock.at(self.clock.now + seconds, lambda: self._end(chunks))

    def _begin_demand(self, flight: Flight) -> int:
        """Tokens a waiting prefill would compute (its prefix as the caches hold it now)."""
        r = flight.request
        own = self.cache.match(r.blocks, r.prompt_len).reused
        return max(1, r.prompt_len - max(own, flight.booking.prefix_tokens))

    def _begin(self, flight: Flight) -> float:
        """It leaves the queue (the head: the queue is served in order) and starts: its prefix
        found (own caches, else fetched); the fetch's ms."""
        _, head = heapq.heappop(self._queue)
        assert head is flight
        self._started.append(flight)
        r = flight.request
        flight.hits = self.cache.match(r.blocks, r.prompt_len)
        own = flight.hits.reused
        flight.prefix_tokens = min(max(own, flight.booking.prefix_tokens), r.prompt_len - 1)
        flight.done_tokens = 0
        if self.cache.can_acquire(r.blocks, r.prompt_len):
            table, _ = self.cache.acquire(r.blocks, r.prompt_len)
            self.cache.release(table)  # its blocks stay cached (evictable) once pushed
        fetch = self.cost.est_transfer_ms(flight.prefix_tokens - own) if flight.prefix_tokens > own else 0.0
        return fetch + self.adapters.use(r.adapter)

    def _end(self, chunks: list[tuple[Flight, int]]) -> None:
        for flight, take in chunks:
            flight.done_tokens += take
            if flight.done_tokens >= flight.new_tokens:
                self._started.remove(flight)
                tail = self.kv_tail * self.cost.est_transfer_ms(flight.request.prompt_len) / 1e3
                self.clock.at(self.clock.now + tail, lambda f=flight: self.on_done(f))
        self._step()


class DecodeWorker(Stepper):
    def __init__(self, worker_id: str, cost: CostModel, clock: Clock, max_seqs: int,
                 on_first: Callable[[Flight], None], on_finish: Callable[[Flight, DecodeBatch], None],
                 cores: Cores = NO_SHARING) -> None:
        super().__init__(worker_id, cost, clock, max_seqs, cores)
        self.on_first = on_first
        self.on_finish = on_finish
        self._joining: list[Flight] = []

    def join(self, flight: Flight) -> None:
        """Its KV arrived: it joins the batch at the next step."""
        self._joining.append(flight)
        if self.stepping:
            self.cut()
        else:
            self._step()

    def _step(self) -> None:
        b = self.batch
        room = b.max_seqs - len(b.running)
        joining, self._joining = self._joining[:room], self._joining[room:]
        for flight in joining:
            b.add(flight, b.steps)
        if not b.running:
            return
        if joining:  # their first tokens end this step: a stretch of one
            self.run_steps([self.cost.est_decode_step_ms(len(b.running), b.context) / 1e3], joining)
        else:
            self.run_steps(self.decode_stretch(), [])

    def end(self, durations: list[float], joined: list[Flight]) -> None:
        for flight in joined:
            self.on_first(flight)
        for flight in self.batch.end_steps(durations):
            self.on_finish(flight, self.batch)
        self._step()


class ColocatedWorker(Stepper):
    """One engine: prefill chunks and decodes in the same steps (module docstring)."""

    def __init__(self, worker_id: str, cost: CostModel, clock: Clock, cache: TieredCache, chunk: int,
                 max_seqs: int, on_first: Callable[[Flight], None],
                 on_finish: Callable[[Flight, DecodeBatch], None], adapters: AdapterSlots | None = None,
                 cores: Cores = NO_SHARING) -> None:
        super().__init__(worker_id, cost, clock, max_seqs, cores)
        self.cache = cache
        self.adapters = adapters or AdapterSlots(4, 0.0)
        self._loading_ms = 0.0  # adapters the next step reads first
        self.chunk = chunk
        self.on_first = on_first
        self.on_finish = on_finish
        self._queue: list[tuple[tuple[int, float, int], Flight]] = []
        self._prefilling: list[Flight] = []  # started, in queue order

    def submit(self, flight: Flight) -> None:
        heapq.heappush(self._queue, (flight.order, flight))
        if self.stepping:
            self.cut()
        else:
            self._step()

    def _admit_prefills(self) -> None:
        """Waiting requests start while sequence slots and KV blocks last (queue order)."""
        while self._queue and len(self.batch.running) + len(self._prefilling) < self.batch.max_seqs:
            flight = self._queue[0][1]
            r = flight.request
            if not self.cache.can_acquire(r.blocks, r.prompt_len):
                return
            heapq.heappop(self._queue)
            flight.table, flight.hits = self.cache.acquire(r.blocks, r.prompt_len)
            flight.prefix_tokens = flight.hits.reused
            flight.done_tokens = flight.prefix_tokens
            self._loading_ms += self.adapters.use(r.adapter)
            self._prefilling.append(flight)

    def _step(self) -> None:
        self._admit_prefills()
        b = self.batch
        budget = self.chunk - len(b.running)
        pieces: list[tuple[Flight, int]] = []
        for flight in self._prefilling:
            if budget <= 0:
                break
            take = min(flight.request.prompt_len - flight.done_tokens, budget)
            pieces.append((flight, take))
            budget -= take
        if not pieces:  # decodes only: a stretch until the next finish or arrival
            if b.running:
                self.run_steps(self.decode_stretch(), pieces)
            return
        seconds = (self.cost.est_decode_step_ms(len(b.running), b.context) + self._loading_ms) / 1e3
        self._loading_ms = 0.0
        for flight, take in pieces:
            seconds += self.cost.est_prefill_ms(take, flight.done_tokens) / 1e3
        self.run_steps([seconds], pieces)

    def end(self, durations: list[float], pieces: list[tuple[Flight, int]]) -> None:
        first = []
        for flight, take in pieces:
            flight.done_tokens += take
            if flight.done_tokens >= flight.request.prompt_len:
                first.append(flight)
        for flight in self.batch.end_steps(durations):  # every step is numbered, prefill-only too
            self._finish(flight)
        for flight in first:
            self._prefilling.remove(flight)
            self.on_first(flight)
            if flight.request.output_len <= 1:
                self._finish(flight)
            else:
                self.batch.add(flight, self.batch.steps - 1)
        self._step()

    def _finish(self, flight: Flight) -> None:
        self.cache.release(flight.table)
        flight.table = []
        self.on_finish(flight, self.batch)
