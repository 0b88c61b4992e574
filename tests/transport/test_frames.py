"""Where a unit's payload is cut into frames (protocol v3): the sender cuts where either end's
views break, so large runs travel in place on both ends; the receiver checks the cuts."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from halfmoon.transport.errors import ProtocolError
from halfmoon.transport.frames import frame_lengths, split_at
from halfmoon.transport.layout import KVBytes
from halfmoon.transport.protocol import FRAME_BYTES, MIN_DIRECT_BYTES, Header, Kind, parse_unit_body, unit_body, unit_frame_lengths

SLAB = 12 << 10  # SmolLM2: 16 tokens x 3 KV heads x 64 dims fp32


def _kv(num_blocks: int) -> KVBytes:
    return KVBytes(torch.zeros(2, 2, num_blocks, 16, 3, 64))


def _bounds_of(views: list[memoryview]) -> list[int]:
    return np.cumsum([v.nbytes for v in views]).tolist()[:-1]


def test_split_at_cuts_exactly_where_asked() -> None:
    views = [memoryview(bytes(range(10))), memoryview(bytes(range(10, 16)))]
    frames = list(split_at(views, [3, 9, 4]))
    assert [b"".join(bytes(v) for v in f) for f in frames] == [bytes(range(3)), bytes(range(3, 12)),
                                                               bytes(range(12, 16))]
    assert [len(f) for f in frames] == [1, 2, 1]


def test_bounds_are_where_the_views_break() -> None:
    kv = _kv(64)
    for ids in ([0, 1, 2, 3], [5, 9, 10, 11, 40], [7], list(range(63, 0, -1))):
        assert kv.bounds(ids) == _bounds_of(kv.views(0, ids))


def test_contiguous_blocks_go_in_place_run_by_run() -> None:
    kv = _kv(512)
    ids = list(range(128))  # a 2048-token prompt: K 1.5 MB, V 1.5 MB
    lengths = unit_frame_lengths(kv, ids, list(range(200, 328)), 256 * SLAB)
    assert lengths == [128 * SLAB, 128 * SLAB]  # one frame per run, nothing staged


@pytest.mark.parametrize("seed", range(20))
def test_random_block_tables_cut_consistently(seed: int) -> None:
    """Any two block tables: the cuts cover the payload, no frame is above FRAME_BYTES, and every
    frame made of a large piece lies in one view on both ends (sent and received in place)."""
    rng = random.Random(seed)
    kv = _kv(1024)
    n = rng.randint(1, 700)
    src = _table(rng, n, contiguous_runs=rng.random() < 0.5)
    dst = _table(rng, n, contiguous_runs=rng.random() < 0.5)
    total = 2 * n * SLAB
    lengths = unit_frame_lengths(kv, src, dst, total)
    assert sum(lengths) == total and all(0 < x <= FRAME_BYTES for x in lengths)
    src_frames = list(split_at(kv.views(0, src), lengths))
    dst_frames = list(split_at(kv.views(0, dst), lengths))
    breaks = set(kv.bounds(src)) | set(kv.bounds(dst))
    pos = 0
    for length, s, d in zip(lengths, src_frames, dst_frames):
        inside = not any(pos < b < pos + length for b in breaks)
        if inside:
            assert len(s) == 1 and len(d) == 1
        else:  # a gathered frame (staged): made of small pieces only
            edges = sorted(breaks | {0, total})
            pieces = [(a, b) for a, b in zip(edges, edges[1:]) if a < pos + length and b > pos]
            assert all(b - a < MIN_DIRECT_BYTES for a, b in pieces), (pos, length, pieces)
        pos += length


def _table(rng: random.Random, n: int, contiguous_runs: bool) -> list[int]:
    ids = rng.sample(range(1024), n)
    return sorted(ids) if contiguous_runs else ids


def test_small_pieces_are_gathered() -> None:
    breaks = [i * SLAB for i in range(1, 256)]  # a fully fragmented table: 12 KB pieces
    assert frame_lengths(breaks, [], 256 * SLAB, FRAME_BYTES, MIN_DIRECT_BYTES) == [256 * SLAB]


def test_large_pieces_are_split_at_frame_bytes() -> None:
    assert frame_lengths([], [], 9 << 20, 4 << 20, 256 << 10) == [4 << 20, 4 << 20, 1 << 20]


@pytest.mark.parametrize("lengths, why", [([100, 100], "short"), ([0, 300], "empty frame"),
                                          ([FRAME_BYTES + 1, 10], "oversized")])
def test_bad_cuts_are_refused(lengths: list[int], why: str) -> None:
    payload = 300 if why != "oversized" else FRAME_BYTES + 11
    header = Header(Kind.UNIT, num_blocks=2, payload_len=payload, count=len(lengths))
    with pytest.raises(ProtocolError, match="frame lengths"):
        parse_unit_body(header, unit_body("r1", [3, 4], lengths))


def test_a_good_body_round_trips() -> None:
    header = Header(Kind.UNIT, num_blocks=3, payload_len=3000, count=2)
    assert parse_unit_body(header, unit_body("req-7", [1, 2, 9], [1000, 2000])) == ("req-7", [1, 2, 9], [1000, 2000])
