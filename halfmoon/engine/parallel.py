"""Tensor parallelism: which part of every weight a rank holds, and the collectives between ranks.

Megatron-style sharding of the decoder (engine/model.py) over `world` ranks; rank r holds

    attention   its KV heads and the query heads that read them (q/k/v rows: column-parallel,
                qkv bias alike; q/k norms replicated); o_proj's matching input columns
                (row-parallel, then all_reduce)
    MLP         a slice of the intermediate size: gate/up rows (column-parallel), down's input
                columns (row-parallel, then all_reduce)
    embedding   a slice of the vocabulary (masked lookup, then all_reduce)
    lm head     the same vocabulary slice (its logits gathered on rank 0, which samples)
    norms, the residual stream: replicated

KV heads per rank (`plan_shard`):

    num_kv_heads >= world   contiguous runs of heads, sizes differing by at most one (SmolLM2's
                            3 KV heads over 2 ranks: [0, 1] and [2]); each rank's query heads are
                            the groups of its KV heads, so head counts need not divide by world
    num_kv_heads <  world   replicated: rank r holds KV head r * num_kv_heads // world, and an
                            equal share of that head's query group (world a multiple of
                            num_kv_heads, the group a multiple of world // num_kv_heads)

Int4 layers keep a GGUF's (or `quantize_q4`'s) groups of 32 along the input dimension: a
row-parallel shard's columns must start and end on a group boundary, so the per-shard int4
weights are exactly the unsharded ones (checked here; the MLP is split in units of 32). Int8
keeps the whole row's scale in a row-parallel shard (`Int8Linear.input_shard`).

Collectives go through a `TPGroup`: a process group of its own (gloo on CPU, NCCL on CUDA) over a
TCP store, never torch's default group (a process may hold several tensor-parallel engines).
Every collective has the group's timeout; a peer that dies or stalls raises `RankLostError`.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from halfmoon.core.blocks import cdiv
from halfmoon.engine.errors import CollectiveInitError, RankLostError, ShardingError
from halfmoon.engine.model_config import ModelConfig
from halfmoon.kernels.quant_linear import GROUP, Q4Groups
from halfmoon.transport.heads import kv_head_range

# A collective that waits longer than this for a peer fails the step (`RankLostError`): a rank
# that died closes its sockets and fails it at once; this bounds a rank that hangs.
COLLECTIVE_TIMEOUT_S = 60.0


def span(n: int, rank: int, world: int, unit: int = 1) -> slice:
    """Rank `rank`'s contiguous share of `n` items in units of `unit`: shares differ by at most
    one unit, the larger ones first."""
    if n % unit:
        raise ShardingError(f"{n} is not a multiple of the sharding unit {unit}")
    base, extra = divmod(n // unit, world)
    start = rank * base + min(rank, extra)
    return slice(start * unit, (start + base + (rank < extra)) * unit)


@dataclass(frozen=True, slots=True)
class Shard:
    """What rank `rank` of `world` holds (slices index heads, intermediate rows, vocab rows)."""

    rank: int
    world: int
    q_heads: slice
    kv_heads: slice
    ffn: slice
    vocab: slice
    vocab_rows: int  # the largest rank's vocab slice: logits are gathered padded to it

    @property
    def num_heads(self) -> int:
        return self.q_heads.stop - self.q_heads.start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads.stop - self.kv_heads.start

    def qkv_rows(self, head_dim: int) -> tuple[slice, slice, slice]:
        """Rows of q_proj, k_proj and v_proj (and their biases) this rank keeps."""
        q, kv = self.q_heads, self.kv_heads
        kv_rows = slice(kv.start * head_dim, kv.stop * head_dim)
        return slice(q.start * head_dim, q.stop * head_dim), kv_rows, kv_rows

    def o_cols(self, head_dim: int) -> slice:
        """Input columns of o_proj this rank keeps (its query heads' outputs)."""
        return slice(self.q_heads.start * head_dim, self.q_heads.stop * head_dim)


def plan_shard(cfg: ModelConfig, rank: int, world: int, quantization: str = "none") -> Shard:
    """Rank `rank`'s shard of `cfg` (the module docstring's rules); `ShardingError` when `cfg`
    cannot be split over `world` ranks."""
    if not 0 <= rank < world:
        raise ShardingError(f"rank {rank} outside a tensor-parallel group of {world}")
    q_heads, kv_heads = _heads(cfg, rank, world)
    ffn_unit = GROUP if cfg.intermediate_size % (GROUP * world) == 0 else 1
    if cfg.intermediate_size // ffn_unit < world or cfg.vocab_size < world:
        raise ShardingError(f"intermediate size {cfg.intermediate_size} / vocab {cfg.vocab_size} "
                            f"too small for tp {world}")
    shard = Shard(rank, world, q_heads, kv_heads, span(cfg.intermediate_size, rank, world, ffn_unit),
                  span(cfg.vocab_size, rank, world), cdiv(cfg.vocab_size, world))
    if quantization == "int4" and world > 1:
        _check_int4_groups(cfg, shard)
    return shard


def _heads(cfg: ModelConfig, rank: int, world: int) -> tuple[slice, slice]:
    """(query heads, KV heads) of rank `rank`."""
    kv, group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    if kv < world and world % kv:
        raise ShardingError(f"tp {world} over {kv} KV heads: with fewer KV heads than ranks, tp must be "
                            f"a multiple of num_kv_heads (each KV head replicated on tp / num_kv_heads ranks)")
    first, stop = kv_head_range(kv, rank, world)  # the transport moves KV between layouts by the same rule
    if kv >= world:
        return slice(first * group, stop * group), slice(first, stop)
    share = world // kv
    if group % share:
        raise ShardingError(f"tp {world}: KV head's {group} query heads do not split over the {share} "
                            f"ranks that replicate it")
    part = group // share
    start = first * group + (rank % share) * part
    return slice(start, start + part), slice(first, stop)


def _check_int4_groups(cfg: ModelConfig, shard: Shard) -> None:
    cols = shard.o_cols(cfg.head_dim)
    if cols.start % GROUP or cols.stop % GROUP:
        raise ShardingError(f"int4 at tp {shard.world}: o_proj's input columns {cols.start}:{cols.stop} of rank "
                            f"{shard.rank} do not fall on {GROUP}-wide groups (head_dim {cfg.head_dim})")
    if shard.ffn.start % GROUP or shard.ffn.stop % GROUP:
        raise ShardingError(f"int4 at tp {shard.world}: intermediate size {cfg.intermediate_size} does not "
                            f"split into {GROUP}-wide groups")


def full_shard(cfg: ModelConfig) -> Shard:
    """The one shard of an engine that is not tensor-parallel."""
    return plan_shard(cfg, 0, 1)


def take_q4(groups: Q4Groups, rows: slice, cols: slice | None) -> Q4Groups:
    """The rows `rows` and input columns `cols` (on group boundaries) of int4 groups."""
    q, scale, minimum = groups.q[rows], groups.scale[rows], groups.minimum[rows]
    if cols is not None:
        g = slice(cols.start // GROUP, cols.stop // GROUP)
        q, scale, minimum = q[:, cols], scale[:, g], minimum[:, g]
    return Q4Groups(q.contiguous(), scale.contiguous(), minimum.contiguous())


# ---------------------------------------------------------------------------- collectives


def new_store(host: str, port: int, world: int, master: bool, timeout_s: float) -> dist.TCPStore:
    """The rendezvous of a group's ranks: rank 0 is the master (port 0 = any free port)."""
    try:
        return dist.TCPStore(host, port, world, master, timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        raise CollectiveInitError(f"tensor-parallel rendezvous at {host}:{port} failed: {e}") from e


class TPGroup:
    """One tensor-parallel group's collectives; `seconds` counts the time spent in them."""

    def __init__(self, pg: dist.ProcessGroup, rank: int, world: int, backend: str) -> None:
        self.pg, self.rank, self.world, self.backend = pg, rank, world, backend
        self.seconds = 0.0
        self.calls = 0
        # rank 0 names dead peers in its error (engine/tp_engine.py); None: say nothing more
        self.describe_peers: Callable[[], str] | None = None

    @classmethod
    def join(cls, store: dist.Store, rank: int, world: int, device: torch.device,
             timeout_s: float = COLLECTIVE_TIMEOUT_S) -> TPGroup:
        """Join the group (blocks until every rank has): gloo on CPU, NCCL on CUDA; a backend
        that cannot start is a `CollectiveInitError`, never a fallback to another."""
        timeout = datetime.timedelta(seconds=timeout_s)
        backend = "nccl" if device.type == "cuda" else "gloo"
        try:
            if backend == "nccl":
                pg = _nccl_group(store, rank, world, timeout)
            else:
                pg = dist.ProcessGroupGloo(store, rank, world, timeout)
        except (RuntimeError, OSError) as e:
            raise CollectiveInitError(f"{backend} process group (rank {rank} of {world}) failed to start: {e}") from e
        return cls(pg, rank, world, backend)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns it."""
        self._wait(lambda: self.pg.allreduce([t]), "all_reduce")
        return t

    def gather_logits(self, local: torch.Tensor, vocab: int, rows: int) -> torch.Tensor | None:
        """Every rank's vocabulary slice of the logits ([n, its slice], padded to `rows`),
        concatenated on rank 0 ([n, vocab]); None on the other ranks."""
        padded = local.new_zeros(local.shape[0], rows)
        padded[:, : local.shape[1]] = local
        out = [[torch.empty_like(padded) for _ in range(self.world)]] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self._wait(lambda: self.pg.gather(out, [padded], opts), "gather")
        if self.rank != 0:
            return None
        parts = [p[:, : span(vocab, r, self.world).stop - span(vocab, r, self.world).start]
                 for r, p in enumerate(out[0])]
        return torch.cat(parts, dim=1)

    def _wait(self, start: Callable[[], dist.Work], what: str) -> None:
        began = time.perf_counter()
        try:
            start().wait()
        except RuntimeError as e:  # gloo / NCCL: a peer closed its connection, or the timeout
            peers = self.describe_peers() if self.describe_peers is not None else ""
            raise RankLostError(f"tensor-parallel {what} failed on rank {self.rank} of {self.world}"
                                f"{': ' + peers if peers else ''} ({e})") from e
        finally:
            self.seconds += time.perf_counter() - began
            self.calls += 1


def _nccl_group(store: dist.Store, rank: int, world: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
    if not dist.is_nccl_available():
        raise CollectiveInitError("a CUDA tensor-parallel engine needs NCCL; this torch build has none")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world, opts)
