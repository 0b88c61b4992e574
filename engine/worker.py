"""What a prefill and a decode worker share: an engine stepped by its own thread, pinned CPU
threads, a KV layout for the transport, and serving its blocks to other workers by hash.

The worker classes are plain Python; the Conductor's cluster manager runs them as Ray actors
(`ray.remote(PrefillWorker).options(...)`), so they are tested without Ray too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.loop import EngineLoop
from kvpool.cluster_index import HolderId
from kvpool.remote import RemoteBlockReader
from transport.config import TransportConfig
from transport.layout import KVLayout


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker: its identity, engine, transport, and the CPU cores it may use.

    worker_id: unique in the cluster; the Ray actor's name and the holder id in the index.
    cpus: cores to pin this worker's threads to (None = no pinning); torch gets one thread
        per core unless `engine.num_threads` says otherwise.
    """

    worker_id: str
    role: str  # "prefill" | "decode"
    engine: EngineConfig
    transport: TransportConfig = field(default_factory=TransportConfig)
    cpus: tuple[int, ...] | None = None
    node_id: str = "local"

    def engine_config(self) -> EngineConfig:
        threads = self.engine.num_threads or (len(self.cpus) if self.cpus else None)
        return dataclasses.replace(self.engine, worker_id=self.worker_id, node_id=self.node_id,
                                   num_threads=threads)


class BlockFetcher(RemoteBlockReader):
    """Reads blocks from another worker through a callable (the cluster wires it to that worker's
    `serve_blocks`, e.g. over Ray); a failed or timed-out fetch delivers nothing (recompute)."""

    def __init__(self, fetch: Callable[[HolderId, list[bytes]], bytes]) -> None:
        self._fetch = fetch
        self.failures = 0

    def fetch(self, holder: HolderId, hashes: Sequence[bytes], dst: torch.Tensor) -> int:
        try:
            data = self._fetch(holder, list(hashes))
        except Exception:  # the holder died or timed out: the blocks are recomputed instead
            self.failures += 1
            return 0
        row = dst.shape[1]
        n = min(len(data) // row, len(hashes)) if row else 0
        if n:
            dst[:n] = torch.frombuffer(bytearray(data[: n * row]), dtype=torch.uint8).view(n, row)
        return n


class EngineWorker:
    """An engine + its loop thread; subclasses add the prefill or decode verbs."""

    def __init__(self, spec: WorkerSpec, remote: RemoteBlockReader | None = None) -> None:
        if spec.cpus:
            os.sched_setaffinity(0, spec.cpus)
        self.spec = spec
        self.engine = Engine(spec.engine_config(), remote=remote)
        self.layout = KVLayout.of(self.engine.kv_cache, self.engine.model_config.fingerprint)
        self.loop = EngineLoop(self.engine, name=f"{spec.role}-engine").start()

    async def on_engine(self, fn: Callable[[], object]) -> object:
        """Run `fn` on the engine thread (between steps) and await its result."""
        return await asyncio.wrap_future(self.loop.call(fn))

    async def serve_blocks(self, hashes: list[bytes]) -> bytes:
        """The leading blocks of `hashes` this worker holds (device, then host/disk), as bytes."""
        tiers = self.engine.tiers
        if tiers is None or not hashes:
            return b""

        def read() -> bytes:
            buf = torch.empty(len(hashes), tiers.block_bytes, dtype=torch.uint8)
            n = tiers.serve_blocks(hashes, buf)
            return buf[:n].numpy().tobytes()

        return await self.on_engine(read)  # type: ignore[return-value]

    def ping(self) -> dict:
        """Liveness and load, for the cluster manager's health checks and the router."""
        pool, stats = self.engine.pool, self.engine.scheduler.stats
        traffic = self.engine.tiers.traffic if self.engine.tiers is not None else None
        return {"alive": self.loop.alive, "steps": self.loop.steps, "free_blocks": pool.num_free(),
                "total_blocks": pool.num_blocks, "requests": self.loop.watching(),
                "prompt_tokens_computed": stats.prompt_tokens_computed,
                "prompt_tokens_cached": stats.prompt_tokens_cached,
                "blocks_fetched_remote": traffic.fetched_remote if traffic is not None else 0,
                "failure": None if self.loop.failure is None else str(self.loop.failure)}

    def pid(self) -> int:
        return os.getpid()

    def model_info(self) -> dict:
        """What the Conductor needs to tokenize, hash blocks and size requests like this worker."""
        e = self.engine
        return {"max_model_len": e.max_model_len, "vocab_size": e.model_config.vocab_size,
                "fingerprint": e.model_config.fingerprint, "block_size": e.config.block_size,
                "dtype": str(e.config.torch_dtype).removeprefix("torch."),
                "kv_bytes_per_token": e.kv_cache[:, :, 0, 0].numel() * e.kv_cache.element_size()}

    def profile(self, quick: bool = True) -> str:
        """Measure this worker's engine (idle) and return the cost model as JSON."""
        from conductor.cost_model import profile_engine

        return self.loop.call(lambda: profile_engine(self.engine, quick=quick).to_json()).result()

    def close(self) -> None:
        self.loop.stop()
        self.engine.close()


def block_ids_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def as_list(ids: Sequence[int]) -> list[int]:
    return [int(t) for t in ids]


def tokenizer_for_model(model: str):  # -> Tokenizer (without loading the weights)
    """The tokenizer of `model` (alias, GGUF file or HF folder), read from its metadata only."""
    from engine.loader import resolve_model_path
    from engine.tokenizer import Tokenizer

    path = resolve_model_path(model)
    return Tokenizer.from_hf_folder(path) if path.is_dir() else Tokenizer.from_gguf(path)
