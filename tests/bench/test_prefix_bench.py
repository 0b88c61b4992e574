"""`halfmoon bench serve --nodes` and `--spill` (bench/prefix_bench.py): the node layout, the
infinite-cache bound, the counters read from /metrics, the conversation workload and the flags;
the replay itself is run by the bench (docs/BENCHMARKS.md, issue 24) and its path end to end by
tests/e2e/test_multinode.py."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from halfmoon.bench.prefix_bench import (Shape, infinite_cache_bound, render_spill, spill_summary, system_args,
                                 worker_counters)
from halfmoon.bench.serve_args import parse_args, workloads
from halfmoon.bench.workload import Request, Workload
from halfmoon.conductor.backend import BackendStats, WorkerView
from halfmoon.api.metrics import Metrics
from halfmoon.core.messages import WorkerLoad


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
    # distinct full 16-token blocks (a partial block is never cached): the shared two, the fourth's two
    assert bound["working_set_tokens"] == 16 * (2 + 2)


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


def test_the_counters_come_from_the_conductors_own_metrics_page() -> None:
    """The exposition the Conductor serves (labels sorted by prometheus_client), not a hand-written one."""
    loads = {"prefill-0": WorkerLoad(True, 9, 1000, 1456, 0, host_blocks_used=5, host_blocks_total=50,
                                     blocks_from_host=7, blocks_from_disk=2, blocks_fetched_remote=3),
             "prefill-1": WorkerLoad(True, 9, 100, 728, 0, blocks_from_host=1, blocks_served_remote=4)}
    views = tuple(WorkerView(wid, "prefill", True, 0, 0, load, 0.0) for wid, load in loads.items())
    metrics = Metrics(lambda: BackendStats(0, 0, 0, 0, 0, workers=views))
    counters = worker_counters(generate_latest(metrics.registry).decode())
    assert counters == {"fetched": 3.0, "served": 4.0, "from_host": 8.0, "from_disk": 2.0, "device_blocks": 1456.0}


def test_spill_runs_one_node_and_takes_a_generated_conversation_trace(tmp_path) -> None:
    saved = tmp_path / "conv.jsonl"
    args = parse_args(["--synthetic", "conversation", "--requests", "12", "--turns", "2,3", "--think-s", "1,2",
                       "--spill", "--save-trace", str(saved)])
    ((rate, workload),) = workloads(args)
    assert rate is None and len(workload.requests) == 12 and saved.exists()
    assert len(saved.read_text().splitlines()) == 12  # replayable with --trace or `halfmoon sim`
    again = workloads(parse_args(["--trace", str(saved)]))[0][1]
    assert [r.prompt_ids for r in again.requests] == [r.prompt_ids for r in workload.requests]
    for bad in (["--spill", "--nodes", "2", "--prefill", "2", "--decode", "1"], ["--spill", "--compare"],
                ["--synthetic", "conversation", "--think-s", "5"], ["--synthetic", "conversation", "--turns", "0"],
                ["--synthetic", "conversation", "--rates", "1,2"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_a_scaled_trace_shares_the_same_prefixes_at_a_fraction_of_the_tokens(tmp_path) -> None:
    saved = tmp_path / "conv.jsonl"
    full = workloads(parse_args(["--synthetic", "conversation", "--requests", "40", "--save-trace", str(saved)]))[0][1]
    small = workloads(parse_args(["--trace", str(saved), "--scale-tokens", "64"]))[0][1]
    for a, b in zip(full.requests, small.requests, strict=True):
        assert len(b.prompt_ids) == -(-len(a.prompt_ids) * 64 // 512)
    # the same requests share a prefix, of 1/8 the length (to a block)
    for (a1, a2), (b1, b2) in zip(zip(full.requests, full.requests[1:]), zip(small.requests, small.requests[1:])):
        shared = next((i for i, (x, y) in enumerate(zip(a1.prompt_ids, a2.prompt_ids)) if x != y),
                      min(len(a1.prompt_ids), len(a2.prompt_ids)))
        scaled = next((i for i, (x, y) in enumerate(zip(b1.prompt_ids, b2.prompt_ids)) if x != y),
                      min(len(b1.prompt_ids), len(b2.prompt_ids)))
        assert scaled // 64 == shared // 512
    assert "64 tokens per trace block" in small.name
    with pytest.raises(SystemExit):
        parse_args(["--trace", str(saved), "--scale-tokens", "0"])


def _run(system: str, hit: float, **counters: float) -> dict:
    return {"system": system, "completed": 10, "errors": 0, "prefix_hit_rate": hit, "prefill_tokens_saved": 100,
            "blocks_fetched_remote": 0.0, "blocks_served_remote": 0.0, "blocks_from_host": 0.0, "blocks_from_disk": 0.0,
            "device_tier_tokens": 1600.0, "ttft_ms": {"p50": 10.0, "p90": 20.0}, "metrics": {}, "requests": [],
            **counters}


def test_the_spill_report_rates_default_tiers_against_the_bound() -> None:
    args = parse_args(["--synthetic", "conversation", "--spill"])
    workload = _workload(list(range(100, 132)) + [1], list(range(100, 132)) + [2])
    bound = infinite_cache_bound(workload)  # 32 of 66 tokens: 0.485; working set 32 tokens
    runs = [_run("default tiers", 0.47, blocks_from_host=7.0), _run("device only", 0.30)]
    result = spill_summary(args, [], workload, bound, runs)
    assert result["default_tiers_vs_bound"] == pytest.approx(0.47 / bound["hit_rate"])
    assert result["working_set_over_device_tier"] == pytest.approx(32 / 1600)
    assert "requests" not in result["systems"]["default tiers"]
    text = render_spill(result)
    assert "(target >= 0.9: met)" in text and "device only" in text
    low = render_spill(spill_summary(args, [], workload, bound, [_run("default tiers", 0.2), runs[1]]))
    assert "MISSED" in low
