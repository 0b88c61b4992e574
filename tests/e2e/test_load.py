"""Load: 64 concurrent streaming clients (half gRPC, half OpenAI SSE) for 60 s against a real
`halfmoon serve` over the co-located engine. Zero errors besides documented rejections, every
stream complete, the server's RSS stable after warm-up (printed)."""

from __future__ import annotations

import json

import pytest

from bench import api_load

RSS_GROWTH_LIMIT_MB = 100  # after warm-up; measured ~30 MB of a ~2.2 GB process (docs/BENCHMARKS.md)


@pytest.mark.timeout(400)
def test_64_streaming_clients_for_60_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    code = api_load.main(["--clients", "64", "--duration", "60", "--json"])
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    with capsys.disabled():
        print(f"\nload: {summary['completed']} streams, {summary['tokens_per_s']} tok/s, "
              f"rejected {summary['rejected']}, errors {summary['errors']}, RSS MB {summary['rss_mb']}")
    assert summary["errors"] == 0, summary["first_errors"]
    assert summary["incomplete"] == 0
    assert summary["completed"] >= 64  # every client finished at least one stream
    assert set(summary["rejected"]) <= {"RESOURCE_EXHAUSTED", "429"}
    assert summary["rss_mb"]["growth_after_warmup"] < RSS_GROWTH_LIMIT_MB
    assert code == 0
