"""KV between tensor-parallel layouts: which KV heads each rank holds, and which heads move from
which prefill rank to which decode rank when the two workers' layouts differ.

A worker of tensor-parallel size `tp` over a model of `H` KV heads holds on rank r
(`kv_head_range`, the rule engine/parallel.py shards by):

    H >= tp   a contiguous run of heads, run sizes differing by at most one, larger first
              (3 heads over 2 ranks: [0, 2) and [2, 3))
    H <  tp   one head, replicated: rank r holds head r // (tp // H) (tp a multiple of H)

`head_plan(H, p, d)` is the transfer from a prefill worker of tp p to a decode worker of tp d:
each decode rank gets every one of its heads exactly once, from a prefill rank that holds it
(of several replicas, rank `candidates[dst_rank % len(candidates)]`, spreading the reads), and
nothing else. Heads from the same source in a row form one `HeadPiece`; between one (source,
destination) pair there is at most one piece (two contiguous runs intersect in one run; a
replicated source holds one head), so one connection per pair carries one piece:

    p = 2, d = 1, H = 3      prefill rank 0 [h0 h1] --> decode rank 0 [h0 h1 . ]
                             prefill rank 1 [h2]    --> decode rank 0 [ .  . h2]
    p = 1, d = 2, H = 3      prefill rank 0 [h0 h1 h2] --> rank 0 [h0 h1], rank 1 [h2]
    p = 1, d = 2, H = 1      prefill rank 0 [h0] --> rank 0 [h0] and rank 1 [h0] (replicated)
"""

from __future__ import annotations

from typing import NamedTuple

from halfmoon.transport.errors import HandshakeError
from halfmoon.transport.layout import KVLayout


class HeadPiece(NamedTuple):
    """KV heads [start, start + count) (model numbering) moving from `src_rank` to `dst_rank`;
    the offsets are the first of them within each rank's own shard."""

    src_rank: int
    dst_rank: int
    start: int
    count: int
    src_offset: int
    dst_offset: int


def kv_head_range(num_kv_heads: int, rank: int, tp: int) -> tuple[int, int]:
    """[first, stop) of the KV heads rank `rank` of a `tp`-rank worker holds (module docstring);
    HandshakeError when `num_kv_heads` cannot be split over `tp` ranks."""
    if not 0 <= rank < tp or num_kv_heads < 1:
        raise HandshakeError("tp", f"rank {rank} of tp {tp} over {num_kv_heads} KV heads")
    if num_kv_heads >= tp:
        base, extra = divmod(num_kv_heads, tp)
        start = rank * base + min(rank, extra)
        return start, start + base + (rank < extra)
    if tp % num_kv_heads:
        raise HandshakeError("tp", f"tp {tp} over {num_kv_heads} KV heads: with fewer KV heads than ranks, "
                                   "tp must be a multiple of the KV heads")
    head = rank // (tp // num_kv_heads)
    return head, head + 1


def head_plan(num_kv_heads: int, src_tp: int, dst_tp: int) -> tuple[HeadPiece, ...]:
    """Every piece of a transfer from a `src_tp` worker to a `dst_tp` worker (module
    docstring), ordered by (destination, first head)."""
    src = [kv_head_range(num_kv_heads, r, src_tp) for r in range(src_tp)]
    pieces: list[HeadPiece] = []
    for dst_rank in range(dst_tp):
        d0, d1 = kv_head_range(num_kv_heads, dst_rank, dst_tp)
        for head in range(d0, d1):
            holders = [r for r, (s0, s1) in enumerate(src) if s0 <= head < s1]
            s = holders[dst_rank % len(holders)]
            last = pieces[-1] if pieces else None
            if last is not None and (last.src_rank, last.dst_rank) == (s, dst_rank) \
                    and last.start + last.count == head:
                pieces[-1] = last._replace(count=last.count + 1)
            else:
                pieces.append(HeadPiece(s, dst_rank, head, 1, head - src[s][0], head - d0))
    return tuple(pieces)


def piece_between(num_kv_heads: int, src_tp: int, src_rank: int, dst_tp: int, dst_rank: int) -> HeadPiece | None:
    """The heads source rank `src_rank` sends destination rank `dst_rank` (None: none)."""
    for piece in head_plan(num_kv_heads, src_tp, dst_tp):
        if (piece.src_rank, piece.dst_rank) == (src_rank, dst_rank):
            return piece
    return None


def num_sources(num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> int:
    """How many source ranks feed destination rank `dst_rank` (each sends its own DONE)."""
    return sum(1 for p in head_plan(num_kv_heads, src_tp, dst_tp) if p.dst_rank == dst_rank)


def destinations(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[tuple[int, int]]:
    """The (source rank, destination rank) pairs that carry a piece: one connection each."""
    return sorted((p.src_rank, p.dst_rank) for p in head_plan(num_kv_heads, src_tp, dst_tp))


def check_layouts(sender: KVLayout, receiver: KVLayout) -> HeadPiece:
    """The piece a sender of layout `sender` moves to a receiver of layout `receiver`;
    HandshakeError naming the first field that differs (model, block size, dtype, windows...),
    a side whose heads are not its rank's, or a pair that has no heads to move."""
    theirs = sender.model_fields()
    for name, mine in receiver.model_fields().items():
        if theirs[name] != mine:
            raise HandshakeError(name, f"sender has {name}={theirs[name]!r}, receiver has {mine!r}")
    total = receiver.total_kv_heads
    for side, layout in (("sender", sender), ("receiver", receiver)):
        start, stop = kv_head_range(total, layout.rank, layout.tp)
        if (start, stop) != (layout.kv_head_start, layout.kv_head_start + layout.num_kv_heads):
            raise HandshakeError("num_kv_heads", f"the {side}'s rank {layout.rank} of tp {layout.tp} holds KV heads "
                                                 f"[{layout.kv_head_start}, {layout.kv_head_start + layout.num_kv_heads})"
                                                 f", expected [{start}, {stop}) of {total}")
    piece = piece_between(total, sender.tp, sender.rank, receiver.tp, receiver.rank)
    if piece is None:
        raise HandshakeError("rank", f"sender rank {sender.rank} of tp {sender.tp} sends no KV heads to receiver "
                                     f"rank {receiver.rank} of tp {receiver.tp} ({total} KV heads)")
    return piece


def sender_heads(piece: HeadPiece) -> slice:
    """The piece's heads within the sender's shard."""
    return slice(piece.src_offset, piece.src_offset + piece.count)


def receiver_heads(piece: HeadPiece) -> slice:
    """The piece's heads within the receiver's shard."""
    return slice(piece.dst_offset, piece.dst_offset + piece.count)
