"""Load: 64 concurrent streaming clients (half gRPC, half OpenAI SSE) for 30 s against a real
`halfmoon serve` over the co-located engine. Zero errors besides documented rejections, every
stream complete, and the server's anonymous memory (heap: what a leak grows) stable after warm-up,
judged by its floor: the lowest sample of the warm run's last third against its first third. The
last-minus-first growth this test used to bound read 124 MB once in CI: a sample that lands on a
step's transient activations reads ~60 MB high, and VmRSS also counts the memory-mapped weights'
file pages, which come and go with the page cache (docs/BENCHMARKS.md, "Front door under load")."""

from __future__ import annotations

import json

import pytest

from halfmoon.bench import api_load

ANON_GROWTH_LIMIT_MB = 100  # after warm-up (docs/BENCHMARKS.md)


@pytest.mark.timeout(400)
def test_64_streaming_clients_for_30_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    code = api_load.main(["--clients", "64", "--duration", "30", "--json"])
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    with capsys.disabled():
        print(f"\nload: {summary['completed']} streams, {summary['tokens_per_s']} tok/s, "
              f"rejected {summary['rejected']}, errors {summary['errors']}, RSS MB {summary['rss_mb']}, anonymous MB {summary['anon_mb']}")
    assert summary["errors"] == 0, summary["first_errors"]
    assert summary["incomplete"] == 0
    assert summary["completed"] >= 64  # every client finished at least one stream
    assert set(summary["rejected"]) <= {"RESOURCE_EXHAUSTED", "429"}
    assert summary["anon_mb"]["floor_growth_after_warmup"] < ANON_GROWTH_LIMIT_MB
    assert code == 0
