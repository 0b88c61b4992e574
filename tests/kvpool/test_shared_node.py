"""Issue 3, point 3: two processes sharing one Redis and one host arena see each other's blocks.

Process A (a real child process) stores blocks in the node's shared-memory arena and publishes
them in the index as HOST; process B finds them through a lookup, with the right holder and
tier, and reads the very bytes A wrote from the same arena.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np

from halfmoon.kvpool.cluster_index import ClusterIndex, HolderId
from halfmoon.kvpool.host_tier import HostArena
from halfmoon.kvpool.redis_server import EmbeddedRedis
from halfmoon.kvpool.tiers import Tier

REPO = Path(__file__).resolve().parents[2]
SLOT = 256


def test_lookup_from_b_finds_what_a_published_and_b_reads_its_bytes(redis_server: EmbeddedRedis,
                                                                    namespace: str) -> None:
    arena_name = f"hm-node-{uuid.uuid4().hex[:8]}"
    arena = HostArena.create(arena_name, num_slots=8, slot_bytes=SLOT)
    hashes = [bytes([7]) * 8 + i.to_bytes(8, "big") for i in range(4)]
    child = textwrap.dedent(f"""
        import sys
        import numpy as np
        from halfmoon.kvpool.cluster_index import ClusterIndex, HolderId
        from halfmoon.kvpool.host_tier import HostArena
        from halfmoon.kvpool.tiers import Tier
        hashes = {hashes!r}
        arena = HostArena.attach({arena_name!r})
        data = np.stack([np.full({SLOT}, 10 + i, dtype=np.uint8) for i in range(4)])
        assert all(arena.put(hashes, data).stored)
        with ClusterIndex({redis_server.url!r}, HolderId("A", "node0"), namespace={namespace!r}) as index:
            index.publish(hashes, Tier.HOST)
            print("published", flush=True)
            sys.stdin.read()  # stay registered until the parent has looked
        arena.close()
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "published"
        with ClusterIndex(redis_server.url, HolderId("B", "node0"), namespace=namespace) as index:
            best = index.lookup(hashes + [b"\x00" * 16]).best
        assert best is not None
        assert (best.holder, best.length, best.tier) == (HolderId("A", "node0"), 4, Tier.HOST)
        out = np.zeros((4, SLOT), dtype=np.uint8)
        assert arena.get(hashes, out) == [True] * 4
        assert [int(row[0]) for row in out] == [10, 11, 12, 13] and (out == out[:, :1]).all()
        arena.check_integrity()
    finally:
        proc.communicate(timeout=60)
        arena.unlink()
    assert proc.returncode == 0
