"""`halfmoon bench serve --nodes` (bench/prefix_bench.py): the node layout, the infinite-cache
bound and the flags; the replay itself is run by the bench (docs/BENCHMARKS.md, issue 24) and
its path end to end by tests/e2e/test_multinode.py."""

from __future__ import annotations

import pytest

from bench.prefix_bench import Shape, infinite_cache_bound, system_args
from bench.serve_bench import parse_args
from bench.workload import Request, Workload


def _workload(*prompts: list[int]) -> Workload:
    return Workload("t", tuple(Request(float(i), tuple(p), 4) for i, p in enumerate(prompts)), float(len(prompts)))


def test_prefill_workers_spread_over_the_nodes_and_decode_on_the_head() -> None:
    assert Shape(2, 2, 1).resources() == [{"prefill": 1, "decode": 1}, {"prefill": 1}]
    assert Shape(1, 2, 1).resources() == [{"prefill": 2, "decode": 1}]
    assert Shape(3, 2, 2).resources() == [{"decode": 2}, {"prefill": 1}, {"prefill": 1}]
    with pytest.raises(ValueError, match="empty"):
        Shape(4, 2, 1)


def test_the_bound_counts_leading_blocks_seen_before_never_the_last_token() -> None:
    shared = list(range(100, 132))  # 2 blocks of 16
    bound = infinite_cache_bound(_workload(shared + [1, 2, 3], shared + [4, 5], shared, list(range(500, 540))))
    # 2nd: both blocks seen; 3rd: 32 tokens, so only its first block is reusable (the last token is
    # always computed); 1st and 4th: nothing seen before.
    assert bound["cached_tokens"] == 32 + 16
    assert bound["prompt_tokens"] == 35 + 34 + 32 + 40
    assert bound["hit_rate"] == pytest.approx(48 / 141)


def test_the_local_only_system_is_the_same_serve_without_remote_fetch() -> None:
    shape = Shape(2, 2, 1)
    wide = system_args("--worker-threads 2", "127.0.0.1:6379", shape, local_only=False)
    local = system_args("--worker-threads 2", "127.0.0.1:6379", shape, local_only=True)
    assert local == wide + " --no-remote-fetch"
    assert "--ray-address 127.0.0.1:6379 --prefill 2 --decode 1" in wide


def test_nodes_prefill_and_decode_go_together_and_alone() -> None:
    args = parse_args(["--trace", "t.jsonl", "--nodes", "2", "--prefill", "2", "--decode", "1"])
    assert (args.nodes, args.prefill, args.decode) == (2, 2, 1)
    for bad in (["--nodes", "2"], ["--nodes", "2", "--prefill", "2", "--decode", "1", "--compare"]):
        with pytest.raises(SystemExit):
            parse_args(["--trace", "t.jsonl", *bad])
