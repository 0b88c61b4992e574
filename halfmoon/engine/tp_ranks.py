"""The ranks of a tensor-parallel engine: rank 0 is the `Engine` (scheduler, sampler, outputs);
ranks 1..N-1 are processes it spawns (`Ranks.launch`), each loading the weights and keeping its
shard (engine/parallel.py) and its own KV cache: its KV heads of the same blocks.

    rank 0                                          rank r > 0 (`follower_main`)
    schedule; runner.prepare -> StepInputs
    send_step: the inputs as one int64 packet  -->  recv: the packet -> StepInputs
    model.forward  <-- all_reduce / gather -->      model.forward (same step, its shard)
    sample from the gathered logits                 (logits: nothing; waits for the next packet)

A step's inputs travel over a pipe per rank (one write each): it wakes a rank that sits idle
between requests for any length of time (a collective would time out there), and a closed pipe
means rank 0 is gone, so an orphaned rank exits. The step's tensors travel in the collectives:
per layer two all_reduces (o and down), one for the embedding, one gather of the logits.

The ranks are `python -c` subprocesses (not multiprocessing's spawn, which re-imports the parent's
`__main__`: a Ray worker's, a script's), holding one end of a socket pair as their pipe.

Every rank's KV cache lives in a shared-memory file rank 0 creates (`KVShm`, unlinked once both
have mapped it): rank 0 sees each rank's shard of every block (`Ranks.kv_caches`), so the KV
transport moves each rank's heads to and from its own shard (engine/kv_shards.py) while the
rank itself only ever reads and writes it inside the steps rank 0 hands it.

Start: rank 0 spawns the ranks; each says "up" over its pipe, joins the process group with rank 0,
loads and shards the weights, allocates its KV cache and says "ready" (or "error" with why). A
rank that exits or errs before "ready" is a `CollectiveInitError` naming it; a rank lost later
fails rank 0's next collective (`RankLostError`, naming the ranks that exited).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from halfmoon.engine.config import EngineConfig
from halfmoon.engine.errors import CollectiveInitError, RankLostError
from halfmoon.engine import parallel
from halfmoon.engine.parallel import TPGroup, new_store, plan_shard
from halfmoon.engine.loader import load_weights
from halfmoon.engine.model import DecoderModel
from halfmoon.engine.model_config import ModelConfig
from halfmoon.engine.runner import StepInputs
from halfmoon.kernels.attention import AttentionMetadata, DecodeBatch, PrefillSegment, get_backend

log = logging.getLogger(__name__)

STEP, STOP = 0, 1
# cmd, tokens, decodes, decode table columns, decodes' max context, prefills, logits rows, rope lens?,
# decode rows per request? (a verification step's q_lens)
HEADER = 9
PREFILL_FIELDS = 4  # q_start, q_len, ctx_len, table length
START_TIMEOUT_S = 300.0  # a rank loading a large model
STOP_TIMEOUT_S = 10.0
HOST = "127.0.0.1"  # a tensor-parallel engine's ranks share one machine


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What a spawned rank needs: the engine's config, its place, the rendezvous, the KV size."""

    config: EngineConfig
    rank: int
    world: int
    port: int
    num_blocks: int
    timeout_s: float
    kv_path: str  # the shared-memory file of this rank's KV cache (created by rank 0)


# ---------------------------------------------------------------------------- step packets


def encode_step(inputs: StepInputs) -> bytes:
    """One step's inputs as int64s: a header, then ids, positions, slots, the decode batch's
    tables, lengths and (a speculative verification's) rows per request, each prefill segment's
    (q_start, q_len, ctx_len, table length) and table, the logits rows and the rope lengths
    (masks are rebuilt from these)."""
    meta, dec = inputs.meta, inputs.meta.decode
    header = [STEP, meta.num_tokens, dec.num if dec else 0, dec.block_tables.shape[1] if dec else 0,
              dec.max_ctx if dec else 0, len(meta.prefills), inputs.logits_rows.numel(),
              int(inputs.rope_lens is not None), int(dec is not None and dec.q_lens is not None)]
    parts = [torch.tensor(header), inputs.input_ids, inputs.positions, meta.slot_mapping]
    if dec is not None:
        parts += [dec.block_tables, dec.ctx_lens]
        if dec.q_lens is not None:
            parts.append(dec.q_lens)
    if meta.prefills:
        parts.append(torch.tensor([v for s in meta.prefills
                                   for v in (s.q_start, s.q_len, s.ctx_len, s.block_table.numel())]))
        parts += [s.block_table for s in meta.prefills]
    parts.append(inputs.logits_rows)
    if inputs.rope_lens is not None:
        parts.append(inputs.rope_lens)
    return torch.cat([p.to("cpu", torch.int64).reshape(-1) for p in parts]).numpy().tobytes()


def stop_packet() -> bytes:
    return torch.tensor([STOP] + [0] * (HEADER - 1)).numpy().tobytes()


class _Reader:
    def __init__(self, values: torch.Tensor) -> None:
        self.values, self.at = values, HEADER

    def take(self, n: int) -> torch.Tensor:
        out = self.values[self.at : self.at + n]
        self.at += n
        return out


def decode_step(data: bytes) -> StepInputs | None:
    """`encode_step`'s packet back as the runner's `StepInputs`; None for a stop packet."""
    values = torch.frombuffer(bytearray(data), dtype=torch.int64)
    cmd, tokens, n_dec, cols, max_ctx, n_pre, n_rows, has_rope, has_q = values[:HEADER].tolist()
    if cmd == STOP:
        return None
    r = _Reader(values)
    ids, positions, slots = r.take(tokens), r.take(tokens), r.take(tokens)
    decode = None
    if n_dec:
        tables, lengths = r.take(n_dec * cols).view(n_dec, cols), r.take(n_dec)
        decode = _decode_batch(tables, lengths, max_ctx, r.take(n_dec) if has_q else None)
    fields = r.take(n_pre * PREFILL_FIELDS).view(n_pre, PREFILL_FIELDS).tolist()
    prefills = [_segment(q_start, n, ctx, r.take(nb)) for q_start, n, ctx, nb in fields]
    rows = r.take(n_rows)
    rope_lens = r.take(tokens) if has_rope else None
    meta = AttentionMetadata(slot_mapping=slots, decode=decode, prefills=prefills, num_tokens=tokens)
    return StepInputs(ids, positions, meta, rows, [], rope_lens)


def _decode_batch(tables: torch.Tensor, lengths: torch.Tensor, max_ctx: int,
                  q_lens: torch.Tensor | None) -> DecodeBatch:
    """As ModelRunner._decode_batch: with rows per request (a verification) the backends build
    their own masks; one row each, a mask when the contexts differ."""
    n = len(lengths)
    if q_lens is not None:
        return DecodeBatch(n, tables, lengths, max_ctx, None, q_lens=q_lens)
    mask = None
    if int(lengths.min()) != max_ctx:
        mask = (torch.arange(max_ctx).unsqueeze(0) < lengths.unsqueeze(1)).view(n, 1, 1, max_ctx)
    return DecodeBatch(n, tables, lengths, max_ctx, mask)


def _segment(q_start: int, n: int, ctx: int, table: torch.Tensor) -> PrefillSegment:
    """As ModelRunner._prefill_segments: a chunk after earlier tokens sees keys 0..its position."""
    start = ctx - n
    mask = None
    if start > 0:
        mask = torch.arange(ctx).unsqueeze(0) <= (torch.arange(n) + start).unsqueeze(1)
    return PrefillSegment(q_start, n, table, ctx, mask)


# ---------------------------------------------------------------------------- rank 0's side


class KVShm:
    """A rank's KV cache in a shared-memory file: rank 0 creates it zeroed and maps it; the rank
    maps the same file (`kv_cache_at`); the name is unlinked once the rank is ready (or gone),
    so nothing outlives the two mappings, a rank killed by -9 included."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self.path = tempfile.mkstemp(prefix="halfmoon-tp-kv-", dir=root)
        try:
            os.ftruncate(fd, _nbytes(shape, dtype))
        finally:
            os.close(fd)
        self.tensor = kv_cache_at(self.path, shape, dtype)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:  # unlinked already
            pass


def kv_cache_at(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The KV cache in the shared-memory file `path` (`KVShm`), mapped shared."""
    raw = torch.from_file(path, shared=True, size=_nbytes(shape, dtype), dtype=torch.uint8)
    return raw.view(dtype).view(shape)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def kv_shape(cfg: ModelConfig, config: EngineConfig, rank: int, num_blocks: int) -> tuple[int, ...]:
    """Rank `rank`'s KV cache: [layers, 2, blocks, block_size, its KV heads, head_dim]."""
    shard = plan_shard(cfg, rank, config.tp, config.quantization)
    return (cfg.num_layers, 2, num_blocks, config.block_size, shard.num_kv_heads, cfg.head_dim)


class Ranks:
    """Rank 0's handle on ranks 1..N-1: their processes, pipes, KV caches (shared memory) and
    the group's collectives."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], conns: list[Connection], store: object,
                 group: TPGroup, kv: list[KVShm]) -> None:
        self.procs, self.conns, self.store, self.group = procs, conns, store, group
        self.kv = kv
        self.failed: BaseException | None = None
        group.describe_peers = self.describe
        self._closing = threading.Event()

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """Ranks 1..N-1's KV caches (rank 0's view of their shared memory)."""
        return [k.tensor for k in self.kv]

    @classmethod
    def launch(cls, config: EngineConfig, num_blocks: int, cfg: ModelConfig, timeout_s: float | None = None) -> Ranks:
        """Spawn ranks 1..tp-1 (each KV cache `cfg`'s shard of `num_blocks` blocks) and join the
        group with them; `wait_ready` before the first step. `timeout_s`: every collective's
        (default `COLLECTIVE_TIMEOUT_S`)."""
        timeout_s = timeout_s or parallel.COLLECTIVE_TIMEOUT_S
        store = new_store(HOST, 0, config.tp, True, timeout_s)
        procs: list[subprocess.Popen[bytes]] = []
        conns: list[Connection] = []
        kv: list[KVShm] = []
        try:
            for rank in range(1, config.tp):
                kv.append(KVShm(kv_shape(cfg, config, rank, num_blocks), config.torch_dtype))
                proc, conn = _spawn(RankSpec(config, rank, config.tp, store.port, num_blocks, timeout_s, kv[-1].path))
                procs.append(proc)
                conns.append(conn)
            for rank in range(1, config.tp):
                _expect(procs[rank - 1], conns[rank - 1], rank, "up", START_TIMEOUT_S)
            group = TPGroup.join(store, 0, config.tp, torch.device("cpu"), timeout_s)
        except BaseException:
            _stop(procs, conns)
            for k in kv:
                k.unlink()
            raise
        return cls(procs, conns, store, group, kv)

    def wait_ready(self) -> None:
        """Until every rank holds its shard and KV cache; `CollectiveInitError` naming one that failed."""
        try:
            for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
                _expect(proc, conn, rank, "ready", START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        finally:
            for k in self.kv:
                k.unlink()  # both ends have mapped it (or the rank is gone)

    def send_step(self, inputs: StepInputs) -> None:
        """Hand the step's inputs to every rank (the runner calls this before its forward)."""
        if self.failed is not None:
            raise RankLostError(f"this tensor-parallel engine lost a rank earlier: {self.failed}")
        packet = encode_step(inputs)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(packet)
            except OSError as e:  # BrokenPipeError: the rank is gone
                self.failed = RankLostError(f"tensor-parallel rank {rank} is gone: {self.describe()} ({e})")
                raise self.failed from e

    def describe(self) -> str:
        """The ranks that exited (with their exit codes), or that all are running."""
        dead = []
        for rank, proc in enumerate(self.procs, start=1):
            try:
                code = proc.wait(0.5)  # a rank whose sockets just closed is exiting
            except subprocess.TimeoutExpired:
                continue
            dead.append(f"rank {rank} (pid {proc.pid}) exited with code {code}")
        return "; ".join(dead) if dead else "every rank's process is running"

    def watch(self, on_lost: Callable[[str], None], interval_s: float = 0.2) -> None:
        """Call `on_lost(why)` once, from a thread of its own, when a rank's process exits while
        the engine is not closing: an idle engine learns of it without waiting for a step."""

        def run() -> None:
            while not self._closing.wait(interval_s):
                if any(p.poll() is not None for p in list(self.procs)):
                    if not self._closing.is_set():
                        on_lost(f"tensor-parallel rank lost: {self.describe()}")
                    return

        threading.Thread(target=run, name="tp-rank-watch", daemon=True).start()

    def pids(self) -> list[int]:
        """The processes of ranks 1..N-1."""
        return [p.pid for p in self.procs]

    def close(self) -> None:
        """Stop every rank (a stop packet, then kill past `STOP_TIMEOUT_S`)."""
        self._closing.set()
        _stop(self.procs, self.conns)
        for k in self.kv:
            k.unlink()
        self.procs, self.conns = [], []


def _spawn(spec: RankSpec) -> tuple[subprocess.Popen[bytes], Connection]:
    """Start rank `spec.rank` with one end of a socket pair; it reads `spec` from it first."""
    ours, theirs = socket.socketpair()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    code = f"from halfmoon.engine.tp_ranks import follower_entry; follower_entry({theirs.fileno()})"
    proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()], env=env)
    theirs.close()
    conn = Connection(ours.detach())
    conn.send(spec)
    return proc, conn


def _expect(proc: subprocess.Popen[bytes], conn: Connection, rank: int, what: str, timeout_s: float) -> None:
    """Wait for rank `rank`'s `what` message; a rank that exits, errs or stays silent is a
    `CollectiveInitError` saying which and why."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.1):
        if proc.poll() is not None:
            break
        if time.monotonic() > deadline:
            raise CollectiveInitError(f"tensor-parallel rank {rank} (pid {proc.pid}) not {what} after {timeout_s:.0f} s")
    try:
        message = conn.recv()
    except (EOFError, OSError):
        raise CollectiveInitError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                                  f"{_exit_code(proc)} before it was {what}") from None
    if message[0] == "error":
        raise CollectiveInitError(f"tensor-parallel rank {rank} failed before it was {what}: {message[1]}")
    if message[0] != what:
        raise CollectiveInitError(f"tensor-parallel rank {rank} said {message[0]!r}, expected {what!r}")


def _exit_code(proc: subprocess.Popen[bytes]) -> int | None:
    try:
        return proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None


def _stop(procs: list[subprocess.Popen[bytes]], conns: list[Connection]) -> None:
    for conn in conns:
        try:
            conn.send_bytes(stop_packet())
        except OSError:  # already gone
            pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("tensor-parallel rank (pid %s) did not stop in %.0f s: killed", proc.pid, STOP_TIMEOUT_S)
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
    for conn in conns:
        conn.close()


# ---------------------------------------------------------------------------- ranks 1..N-1


def follower_entry(fd: int) -> None:
    """A rank's process: its pipe is the socket `fd`; the first message is its `RankSpec`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tp-rank %(levelname)s %(name)s: %(message)s")
    conn = Connection(fd)
    follower_main(conn.recv(), conn)


def follower_main(spec: RankSpec, conn: Connection) -> None:
    """A spawned rank: join the group, build its shard, then run every step rank 0 sends."""
    try:
        if spec.config.num_threads is not None:
            torch.set_num_threads(spec.config.num_threads)
        conn.send(("up",))
        store = new_store(HOST, spec.port, spec.world, False, spec.timeout_s)
        group = TPGroup.join(store, spec.rank, spec.world, torch.device("cpu"), spec.timeout_s)
        model, kv_cache = _build(spec, group)
        conn.send(("ready",))
    except Exception as e:  # told to rank 0, which raises it as CollectiveInitError
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1) from e
    _serve(conn, model, kv_cache)


def _build(spec: RankSpec, group: TPGroup) -> tuple[DecoderModel, torch.Tensor]:
    config = spec.config
    weights = load_weights(config.model, config.torch_dtype, q4_blocks=config.quantization == "int4")
    cfg = weights.config
    shard = plan_shard(cfg, spec.rank, spec.world, config.quantization)
    max_len = min(config.max_model_len or cfg.max_position, cfg.max_position)
    model = DecoderModel(cfg, weights.weights, get_backend(config.attention_backend), config.torch_dtype,
                         config.quantization, weights.q4, max_len, weights.wide, shard, group)
    kv_cache = kv_cache_at(spec.kv_path, kv_shape(cfg, config, spec.rank, spec.num_blocks), config.torch_dtype)
    return model, kv_cache


def _serve(conn: Connection, model: DecoderModel, kv_cache: torch.Tensor) -> None:
    """Run each step rank 0 sends until a stop packet, or rank 0 is gone (its pipe closed)."""
    while True:
        try:
            inputs = decode_step(conn.recv_bytes())
        except (EOFError, OSError):
            log.warning("tensor-parallel rank 0 is gone: this rank exits")
            return
        if inputs is None:
            return
        try:
            model.forward(inputs.input_ids, inputs.positions, kv_cache, inputs.meta, inputs.logits_rows,
                          None, inputs.rope_lens)
        except RankLostError as e:
            log.error("%s: this rank exits", e)
            raise SystemExit(1) from e
