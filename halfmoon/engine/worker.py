"""What a prefill and a decode worker share: an engine stepped by its own thread, pinned CPU
threads, a KV layout for the transport, and serving its blocks to other workers by hash.

The worker classes are plain Python with async verbs that take and return the typed messages of
`core.messages` (they satisfy its `PrefillApi` / `DecodeApi` protocols as they are); the
Conductor runs them as Ray actors (conductor/ray_workers.py) and tests drive them directly.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from tqdm import tqdm

from halfmoon.core.adapters import AdapterRef
from halfmoon.core.logs import configure_logging
from halfmoon.core.messages import EngineInfo, IntegrityError, IntegrityReport, Profile, WorkerLoad
from halfmoon.core.params import SamplingParams
from halfmoon.core.tracing import start_tracing
from halfmoon.engine.config import WorkerSpec
from halfmoon.engine.engine import Engine
from halfmoon.engine.errors import RankLostError
from halfmoon.engine.loop import EngineLoop
from halfmoon.engine.profiling import ProgressBar, measure_engine
from halfmoon.engine.request import Request
from halfmoon.kvpool.block_pool import BlockPool
from halfmoon.kvpool.cluster_index import HolderId
from halfmoon.kvpool.errors import KVPoolError
from halfmoon.kvpool.remote import RemoteBlockReader
from halfmoon.transport.blocks import BlockClient, BlockServer, Fetched
from halfmoon.transport.config import TransportConfig, advertised_address
from halfmoon.transport.layout import KVLayout

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 5.0  # one remote block fetch; past it the blocks are recomputed
# A standby's warm-up request: a prompt of two chunks' worth of small ids, a few decode steps.
WARM_UP_PROMPT_TOKENS, WARM_UP_TOKENS, WARM_UP_SALT = 48, 4, "halfmoon-warm-up"


def _process_start() -> float:
    """When this process began (Unix s): how long a restarted worker took to come up."""
    import psutil

    return psutil.Process().create_time()


def engine_load(engine: Engine, loop: EngineLoop) -> WorkerLoad:
    """An engine's liveness and load: its device pool, running batch, tiers and prefix hits
    (a worker's health answer; the co-located backend's one worker on the dashboard)."""
    pool, stats, tiers = engine.pool, engine.scheduler.stats, engine.tiers
    load = WorkerLoad(loop.alive, loop.steps, pool.num_free(), pool.num_blocks, loop.watching(),
                      stats.prompt_tokens_computed, stats.prompt_tokens_cached,
                      failure=None if loop.failure is None else str(loop.failure),
                      running=len(engine.scheduler.running), decode_entries=stats.decode_entries,
                      decode_tokens=stats.decode_tokens, decode_single=stats.decode_single)
    if engine.lora is not None and engine.lora.stats.requests:
        load = replace(load, adapters=tuple(engine.lora.resident() + engine.lora.cached()),
                       lora=engine.lora.counters())
    if engine.speculator is not None:
        spec = engine.speculator.stats
        load = replace(load, spec_verifications=spec.steps, spec_proposed=spec.proposed,
                       spec_accepted=spec.accepted, spec_emitted=spec.emitted)
    if tiers is None:
        return load
    host, disk, traffic = tiers.host, tiers.disk, tiers.traffic
    load = replace(load, blocks_fetched_remote=traffic.fetched_remote,
                   blocks_from_host=traffic.promoted_from_host, blocks_from_disk=traffic.promoted_from_disk,
                   host_blocks_used=host.num_used() if host is not None else 0,
                   host_blocks_total=host.capacity if host is not None else 0,
                   disk_blocks_used=disk.num_used() if disk is not None else 0,
                   disk_blocks_total=disk.capacity if disk is not None else 0)
    if tiers.index is None:
        return load
    return replace(load, index_heartbeat_max_gap_s=tiers.index.stats.max_heartbeat_gap_s,
                   index_resyncs=tiers.index.stats.resyncs)


class TransportBlockReader(RemoteBlockReader):
    """kvpool's remote reads over the transport: blocks come from the holder's `BlockServer`
    (transport.blocks), whose address `resolve(holder)` finds (a worker resolves it from the
    block servers the Conductor named in its last task; cached until a fetch from it fails,
    e.g. after a restart on another port). A failed or timed-out fetch delivers nothing: the
    blocks are recomputed."""

    def __init__(self, resolve: Callable[[HolderId], str], timeout_s: float = 5.0) -> None:
        self._resolve = resolve
        self.timeout_s = timeout_s
        self.client: BlockClient | None = None  # bound by the worker once its KV layout exists
        self._addresses: dict[HolderId, str] = {}
        self.failures = 0
        self.in_flight = 0  # fetches waiting on a holder now (the engine thread's one, at most)

    def bind(self, layout: KVLayout, config: TransportConfig) -> None:
        self.client = BlockClient(layout, config.make_backend(), config.secret(), self.timeout_s)

    def fetch(self, holder: HolderId, hashes: Sequence[bytes], dst: torch.Tensor) -> int:
        if self.client is None:
            return 0
        try:
            address = self._addresses.get(holder) or self._resolve(holder)
        except Exception as e:  # the holder is gone (or Ray is): recompute
            self.failures += 1
            log.warning("no block server address for %s: %s", holder, e)
            return 0
        self.in_flight += 1
        try:
            outcome = self.client.fetch_outcome(address, hashes, dst)
        except Exception as e:  # e.g. the holder's machine vanished mid-handshake: recompute
            log.warning("pulling %d blocks from %s at %s failed (they are recomputed): %s", len(hashes),
                        holder.key, address, e)
            outcome = Fetched(0, True)
        finally:
            self.in_flight -= 1
        if outcome.failed:
            self.failures += 1
            self._addresses.pop(holder, None)  # ask again next time
        else:
            self._addresses[holder] = address
        return outcome.count

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


class EngineWorker:
    """An engine + its loop thread; subclasses add the prefill or decode verbs."""

    # The profile's progress bar (tqdm's signature); a Ray actor draws its bar on the driver.
    progress_bar: ProgressBar = tqdm

    def __init__(self, spec: WorkerSpec, remote: RemoteBlockReader | None = None) -> None:
        """`remote`: how prefixes held by other workers are read (default: over the transport,
        from the block servers the Conductor names in each task; see `learn_block_servers`)."""
        started = time.monotonic()
        if spec.cpus:
            os.sched_setaffinity(0, spec.cpus)
        self.spec = spec
        configure_logging(spec.log)
        # Tracing asked for and impossible fails the worker's start, as it fails the Conductor's.
        self.tracer = start_tracing(spec.tracing, spec.role, spec.worker_id)
        self._block_servers: Mapping[str, str] = {}
        remote = remote or TransportBlockReader(self._block_server_of, FETCH_TIMEOUT_S)
        self.engine = Engine(spec.engine_config(), remote=remote)
        self.layout = self.engine.kv_layout()
        self.loop = EngineLoop(self.engine, name=f"{spec.role}-engine").start()
        if self.engine.ranks is not None:  # a rank that dies takes the worker down as one
            self.loop.on_rank_lost = self.rank_lost
            self.engine.ranks.watch(lambda why: self.rank_lost(RankLostError(why)))
        self.remote = remote
        if isinstance(remote, TransportBlockReader):
            remote.bind(self.layout, spec.transport)
        self.block_server = self._start_block_server()
        log.info("worker %s ready: %.2f s to start, %.2f s since its process began", spec.worker_id,
                 time.monotonic() - started, time.time() - _process_start())

    def _start_block_server(self) -> BlockServer | None:
        """Serve this worker's blocks (device, host, disk) to the others by hash."""
        tiers, t = self.engine.tiers, self.spec.transport
        if tiers is None:
            return None

        def serve(hashes: list[bytes], rows: torch.Tensor) -> int:
            return self.loop.call(lambda: tiers.serve_blocks(hashes, rows)).result(t.timeout_s)  # type: ignore[return-value]

        return BlockServer(serve, self.layout, tiers.block_bytes, t.make_backend(), host=t.host,
                           secret=t.secret(), timeout=t.timeout_s).start()

    def learn_block_servers(self, block_servers: Mapping[str, str]) -> None:
        """Where the other workers serve their blocks, as of the Conductor's latest task."""
        self._block_servers = block_servers

    def _block_server_of(self, holder: HolderId) -> str:
        address = self._block_servers.get(holder.worker_id)
        if address is None:
            raise LookupError(f"no block server known for worker {holder.worker_id}")
        return address

    async def block_address(self) -> str | None:
        """Where other workers fetch this worker's blocks (None: it keeps no tiers)."""
        if self.block_server is None:
            return None
        return advertised_address(self.block_server.address, self.spec.transport.host)

    async def on_engine(self, fn: Callable[[], object]) -> object:
        """Run `fn` on the engine thread (between steps) and await its result."""
        return await asyncio.wrap_future(self.loop.call(fn))

    async def load(self) -> WorkerLoad:
        """Liveness and load, for the cluster manager's health checks and the router."""
        return self.engine_load()

    def engine_load(self) -> WorkerLoad:
        served = self.block_server.served_blocks if self.block_server is not None else 0
        reader = self.remote if isinstance(self.remote, TransportBlockReader) else None
        return replace(engine_load(self.engine, self.loop), blocks_served_remote=served, node_id=self.spec.node_id,
                       tp=self.engine.config.tp,
                       fetches_in_flight=reader.in_flight if reader is not None else 0,
                       fetch_failures=reader.failures if reader is not None else 0)

    async def check_integrity(self) -> IntegrityReport:
        """Check the KV bookkeeping (`block_problems`: the pool's own invariants, the block
        tables, the blocks the role holds beside them) and the role's own rules
        (`hold_problems`); raises IntegrityError naming every broken invariant."""
        held = self.held_blocks()
        problems = self.hold_problems()
        # Queued right after the snapshot: a hold given back after it is freed after the check.
        found, report = await self.on_engine(lambda: self._check_engine(held))  # type: ignore[misc]
        problems += found
        if problems:
            raise IntegrityError(self.spec.worker_id, tuple(problems))
        return report

    def held_blocks(self) -> Mapping[str, Sequence[int]]:
        """Blocks the role holds outside the scheduler, by request id (a decode worker's
        reservations); read on the event loop."""
        return {}

    def hold_problems(self) -> list[str]:
        """Broken rules of the role's own holds, seen from the event loop."""
        return []

    def _check_engine(self, held: Mapping[str, Sequence[int]]) -> tuple[list[str], IntegrityReport]:
        """On the engine thread: the problems of the pool, the tables and `held`, and the report."""
        pool, requests = self.engine.pool, self.engine.scheduler.requests
        problems = block_problems(pool, requests.values(), held)
        report = IntegrityReport(self.spec.worker_id, len(held), sum(map(len, held.values())),
                                 len(requests), pool.num_free(), pool.num_blocks)
        return problems, report

    def rank_lost(self, error: RankLostError) -> None:
        """A rank of this tensor-parallel worker died (or a collective with it failed): the
        worker is down as one. Here its engine loop fails, and every request with it; a Ray
        actor exits instead (conductor/ray_workers.py), so Ray restarts the whole worker and the
        Conductor moves its requests (the migration path) without a client error."""
        log.error("worker %s: %s", self.spec.worker_id, error)
        self.loop.fail(error)

    async def pid(self) -> int:
        return os.getpid()

    async def rank_pids(self) -> list[int]:
        """Every rank's process, rank 0's (this one) first."""
        ranks = self.engine.ranks
        return [os.getpid(), *(ranks.pids() if ranks is not None else [])]

    async def flush_traces(self) -> bool:
        """Export the spans this worker has buffered (the Conductor asks before it stops the
        workers, which kills them); False if the exporter did not finish in time."""
        return await asyncio.to_thread(self.tracer.flush)

    async def engine_info(self) -> EngineInfo:
        """What the Conductor needs to tokenize, hash blocks and size requests like this worker."""
        return self.engine.info()

    async def load_adapter(self, adapter: AdapterRef) -> None:
        """Read `adapter` into the engine's host cache (off the engine's thread and the event loop)."""
        await asyncio.to_thread(self.engine.load_adapter, adapter)

    async def warm_up(self) -> float:
        """A short greedy request through this engine (salted: no one's prefix), so a standby's
        first real step does not pay first-use costs; its seconds."""
        started = time.monotonic()
        prompt = list(range(1, WARM_UP_PROMPT_TOKENS + 1))
        params = SamplingParams(max_tokens=WARM_UP_TOKENS, temperature=0.0, ignore_eos=True)
        await self.on_engine(lambda: self.engine.generate([prompt], params, cache_salt=WARM_UP_SALT))
        return time.monotonic() - started

    async def profile(self, quick: bool = True) -> Profile:
        """Measure this worker's engine (idle); the Conductor fits its cost model to it."""
        return await self.on_engine(lambda: measure_engine(self.engine, quick=quick, bar=self.progress_bar))  # type: ignore[return-value]

    def close(self) -> None:
        if self.block_server is not None:
            self.block_server.close()
        if isinstance(self.remote, TransportBlockReader):
            self.remote.close()
        self.loop.stop()
        self.engine.close()
        self.tracer.shutdown()


def block_problems(pool: BlockPool, requests: Iterable[Request],
                   held: Mapping[str, Sequence[int]]) -> list[str]:
    """Broken invariants of a pool, its requests' block tables and blocks held beside them:
    the pool's own `check_integrity`; every block of a table or a hold is in use; a held block
    is in no request's table, in no other hold, and once in its own."""
    problems = []
    try:
        pool.check_integrity()
    except KVPoolError as e:
        problems.append(f"pool: {e}")
    owner: dict[int, str] = {}
    for req in requests:
        for block in req.block_table:
            owner.setdefault(block, req.request_id)  # prefix blocks may be shared by requests
            if not _in_use(pool, block):
                problems.append(f"block {block} of request {req.request_id!r}'s table is not in use")
    holder: dict[int, str] = {}
    for request_id, blocks in sorted(held.items()):
        for block in blocks:
            if block in holder:
                problems.append(f"block {block} is reserved for both {holder[block]!r} and {request_id!r}")
            holder[block] = request_id
            if not _in_use(pool, block):
                problems.append(f"block {block} reserved for {request_id!r} is not in use")
            if block in owner:
                problems.append(f"block {block} reserved for {request_id!r} is in request {owner[block]!r}'s table")
    return problems


def _in_use(pool: BlockPool, block: int) -> bool:
    """Whether `block` is a block of `pool` held by someone (ref_cnt > 0)."""
    try:
        return pool.ref_cnt(block) > 0
    except KVPoolError:  # not a block of this pool
        return False


def tokenizer_for_model(model: str):  # -> Tokenizer (without loading the weights)
    """The tokenizer of `model` (alias, GGUF file or HF folder), read from its metadata only."""
    from halfmoon.engine.loader import resolve_model_path
    from halfmoon.engine.tokenizer import Tokenizer

    path = resolve_model_path(model)
    return Tokenizer.from_hf_folder(path) if path.is_dir() else Tokenizer.from_gguf(path)
