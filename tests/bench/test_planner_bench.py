"""`halfmoon bench serve --planner-compare`'s pieces that need no cluster (the whole comparison
takes 18 minutes: docs/BENCHMARKS.md). The simulated worker's KV is one decode worker's pool:
the live run summed the decode pool's (and a prefill worker's pool is larger, for its prefix
cache), which gave each simulated decode worker two to three times its KV."""

from __future__ import annotations

from halfmoon.bench.sim_vs_live import largest_worker_blocks

# /metrics of a 1P2D cluster as api/metrics.py writes it (the lines the parser reads): decode-0
# holds 43 blocks (13 used, 3 of them reserved for KV on its way), decode-1 a smaller pool
METRICS = """\
# TYPE halfmoon_worker_up gauge
halfmoon_worker_up{worker="prefill-0",role="prefill"} 1.0
halfmoon_worker_up{worker="decode-0",role="decode"} 1.0
halfmoon_worker_up{worker="decode-1",role="decode"} 1.0
# TYPE halfmoon_worker_kv_blocks gauge
halfmoon_worker_kv_blocks{worker="prefill-0",tier="device",state="free"} 68.0
halfmoon_worker_kv_blocks{worker="decode-0",tier="device",state="free"} 30.0
halfmoon_worker_kv_blocks{worker="decode-0",tier="device",state="used"} 13.0
halfmoon_worker_kv_blocks{worker="decode-0",tier="device",state="reserved"} 3.0
halfmoon_worker_kv_blocks{worker="decode-0",tier="host",state="free"} 300.0
halfmoon_worker_kv_blocks{worker="decode-1",tier="device",state="free"} 40.0
halfmoon_kv_cache_blocks 83.0
"""


def test_the_simulated_worker_holds_one_decode_workers_device_pool() -> None:
    assert largest_worker_blocks(METRICS) == 43


def test_no_decode_worker_no_figure() -> None:
    assert largest_worker_blocks(METRICS.replace('role="decode"', 'role="prefill"')) is None
