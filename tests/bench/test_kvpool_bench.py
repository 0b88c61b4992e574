"""`halfmoon bench kvpool`: trace reading, token synthesis, hashing, the replay's exact hit counts
and the report. Replay only (--skip-bandwidth --skip-index): nothing here is timed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from halfmoon.bench.kvpool_bench import DEFAULT_TRACE, load_requests, main
from halfmoon.bench.kvpool_replay import PrefixHasher, ReplayConfig, replay, upper_bound, usable_blocks
from halfmoon.sim.tiers import HashLRU
from halfmoon.bench.trace import (
    HASH_BLOCK_TOKENS,
    TraceError,
    TraceRequest,
    block_tokens,
    parse_line,
    read_trace,
    synthesize_tokens,
)
from halfmoon.kvpool.block_hash import block_hashes

REPLAY_ONLY = ["--quick", "--json", "--skip-bandwidth", "--skip-index"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Four requests sharing prefixes (block_size 16, 512 tokens per hash id):
#   r1 [1,2]   1024 t: cold, registers 64 full blocks
#   r2 [1,2,3] 1100 t: hits chunks 1,2 = 1024 t; registers 68 full blocks (4 of chunk 3)
#   r3 [1,4]    600 t: hits chunk 1 = 512 t
#   r4 [1,2,3] 1100 t: hits 68 blocks = 1088 t (usable: (1100 - 1) // 16 = 68)
TINY = [
    {"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
    {"timestamp": 1000, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]},
    {"timestamp": 2000, "input_length": 600, "output_length": 10, "hash_ids": [1, 4]},
    {"timestamp": 3000, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]},
]
TINY_PROMPT = 1024 + 1100 + 600 + 1100
TINY_HIT = 1024 + 512 + 1088


def write_trace(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def assert_valid_png(path: str) -> None:
    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC
    with Image.open(path) as image:
        image.verify()


# ---------------------------------------------------------------- trace and tokens


def test_equal_hash_ids_give_equal_blocks_and_the_last_is_truncated() -> None:
    a = TraceRequest(1, 0.0, 1100, 5, (7, 8, 21))
    b = TraceRequest(2, 5.0, 600, 5, (7, 9))
    ta, tb = synthesize_tokens(a), synthesize_tokens(b)
    assert ta.dtype == np.uint32 and len(ta) == 1100 and len(tb) == 600
    assert np.array_equal(ta[:512], tb[:512])  # hash id 7 in both
    assert not np.array_equal(ta[512:600], tb[512:600])  # 8 vs 9
    assert np.array_equal(ta[1024:], block_tokens(21)[:76])  # last block truncated
    assert np.array_equal(block_tokens(21), block_tokens(21))  # deterministic
    assert int(ta.max()) < 49152 and int(block_tokens(3, vocab_size=100).max()) < 100
    assert len(np.unique(block_tokens(5))) > 400  # not a constant block


def test_trace_lines_are_validated_with_their_line_number(tmp_path: Path) -> None:
    ok = parse_line('{"timestamp": 5, "input_length": 513, "output_length": 0, '
                    '"hash_ids": [3, 4], "extra": 1}', 9)
    assert ok == TraceRequest(9, 5.0, 513, 0, (3, 4))
    bad = {
        'not json': "not valid JSON",
        '[1, 2]': "expected a JSON object",
        '{"timestamp": 0, "input_length": 5}': "missing key(s) output_length, hash_ids",
        '{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}': "timestamp",
        '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}': "input_length",
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-1]}': ">= 0",
        '{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [1]}':
            "needs 2 hash ids",
    }
    for text, message in bad.items():
        with pytest.raises(TraceError, match=rf"t\.jsonl:4: .*{re.escape(message)}"):
            parse_line(text, 4, "t.jsonl")
    path = write_trace(tmp_path / "trace.jsonl", TINY[:1])
    path.write_text(path.read_text() + "\n{oops\n")
    with pytest.raises(TraceError, match=r"trace\.jsonl:3: not valid JSON"):
        list(read_trace(path))


def test_main_reports_a_missing_or_bad_trace_clearly(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*REPLAY_ONLY, "--trace", str(tmp_path / "nope.jsonl"),
                 "--out", str(tmp_path)]) == 2
    assert "nope.jsonl not found" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(TINY[0]) + "\n" + '{"timestamp": 1}\n')
    assert main([*REPLAY_ONLY, "--trace", str(bad), "--out", str(tmp_path)]) == 2
    assert "bad.jsonl:2: missing key(s)" in capsys.readouterr().err
    tiny = write_trace(tmp_path / "tiny.jsonl", TINY)
    assert main([*REPLAY_ONLY, "--trace", str(tiny), "--capacities", "8"]) == 2
    assert "longest prompt (69 blocks" in capsys.readouterr().err


# ---------------------------------------------------------------- hashing and the bound


def test_cached_chunk_hashes_equal_hashing_the_synthesized_tokens() -> None:
    requests = load_requests(DEFAULT_TRACE, 0)
    hasher = PrefixHasher()
    for request in requests:
        direct = block_hashes(synthesize_tokens(request).tolist(), 16, hasher.root)
        assert hasher.hashes(request) == direct
    assert len(hasher) == len({ids[:i + 1] for ids in (r.hash_ids for r in requests)
                               for i in range(len(ids))})


def test_upper_bound_equals_a_plain_set_of_seen_blocks() -> None:
    requests = load_requests(DEFAULT_TRACE, 0)
    hasher = PrefixHasher()
    seen: set[bytes] = set()
    expected = 0
    for request in requests:
        hashes = hasher.hashes(request)
        run = next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))
        expected += min(run, usable_blocks(request, 16)) * 16
        seen.update(hashes)
    bound = upper_bound(requests, PrefixHasher())
    assert bound.hit_tokens == expected
    assert bound.prompt_tokens == sum(r.input_length for r in requests)
    assert round(bound.hit_tokens_512 / bound.prompt_tokens, 3) == 0.682  # bench/data/README.md


# ---------------------------------------------------------------- tiers


def test_hash_lru_evicts_least_recent_unpinned_and_reports_what_leaves() -> None:
    lru = HashLRU(2)
    assert lru.put(b"a") is None and lru.put(b"b") is None
    lru.touch([b"a"])
    assert lru.put(b"c") == b"b"  # b was least recent
    pinned = lru.pin([b"a", b"zz"])
    assert pinned == [b"a"]
    assert lru.put(b"d") == b"c"  # a is pinned
    pinned += lru.pin([b"d"])
    assert lru.put(b"e") == b"e"  # everything pinned: not stored
    lru.unpin(pinned)
    assert lru.put(b"a") is None and lru.put(b"e") == b"d"
    assert HashLRU(0).put(b"x") == b"x"
    lru.check_integrity()


# ---------------------------------------------------------------- replay and report


def test_tiny_trace_exact_hits_per_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "tiny.jsonl", TINY)
    report = run_json(capsys, [*REPLAY_ONLY, "--trace", str(trace), "--out", str(tmp_path),
                               "--capacities", "70,200"])
    small, large = report["replay"]["capacities"]
    # 70 blocks: r3's 6 new blocks evict 4 of chunk 3 to host; r4 promotes them from there.
    assert (small["device_tokens"], small["host_tokens"], small["disk_tokens"]) == (2560, 64, 0)
    assert small["device_evictions"] == 8
    assert (large["device_tokens"], large["host_tokens"], large["disk_tokens"]) == (TINY_HIT, 0, 0)
    assert large["prompt_tokens"] == TINY_PROMPT and large["device_evictions"] == 0
    assert report["upper_bound"] == report["hit_rate"] == TINY_HIT / TINY_PROMPT
    assert report["replay"]["upper_bound_512"] == (1024 + 512 + 1100) / TINY_PROMPT
    assert_valid_png(report["plot"])
    no_host = run_json(capsys, [*REPLAY_ONLY, "--trace", str(trace), "--out", str(tmp_path),
                                "--capacities", "70", "--host-ratio", "0"])
    only = no_host["replay"]["capacities"][0]
    assert (only["device_tokens"], only["host_tokens"], only["disk_tokens"]) == (2560, 0, 64)


def test_sample_trace_reaches_the_upper_bound(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, [*REPLAY_ONLY, "--out", str(tmp_path / "out")])
    assert report["replay"]["trace"] == str(DEFAULT_TRACE)
    assert 0 < report["hit_rate"] <= report["upper_bound"] < 1
    assert report["hit_rate"] >= 0.99 * report["upper_bound"]
    assert report["figures"]["hit_rate_16384"]["met"] is True
    runs = report["replay"]["capacities"]
    assert [r["device_blocks"] for r in runs] == [256, 1024, 4096, 16384]
    assert all(r["hit_rate"] <= report["upper_bound"] for r in runs)
    assert runs[0]["host_tokens"] > 0  # the smallest capacity exercises the lower tiers
    assert report["plot"] == str((tmp_path / "out" / "kvpool_hit_rate.png").resolve())
    assert_valid_png(report["plot"])
    saved = json.loads((tmp_path / "out" / "kvpool_bench.json").read_text())
    assert saved["hit_rate"] == report["hit_rate"]
    assert {"command", "date", "machine", "replay_requests_per_s"} <= report.keys()
    assert report["command"].startswith("halfmoon bench kvpool --quick")


def test_concurrent_requests_never_beat_the_bound_and_leak_nothing() -> None:
    requests = load_requests(DEFAULT_TRACE, 0)
    hasher = PrefixHasher()
    bound = upper_bound(requests, hasher)
    config = ReplayConfig(running=8, tpot_ms=50.0)
    for device in (200, 1000):
        result = replay(requests, hasher, config.capacity(device), config)  # checks integrity
        assert result["hit_tokens"] <= bound.hit_tokens
    assert result["hit_tokens"] == bound.hit_tokens


def test_chunks_cover_exactly_the_hash_ids() -> None:
    request = TraceRequest(1, 0.0, 2 * HASH_BLOCK_TOKENS + 20, 1, (5, 6, 7))
    hasher = PrefixHasher()
    assert len(hasher.chunks(request)) == 3
    assert len(hasher.hashes(request)) == (2 * HASH_BLOCK_TOKENS + 20) // 16
