"""Block hashes are deterministic, chained, salted, and pinned by golden vectors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from halfmoon.kvpool.block_hash import HASH_BYTES, block_hashes, chain_hash, root_hash

ROOT = root_hash("fingerprint-abc", "float32", 16)
TOKENS = list(range(40))  # two full blocks of 16 and 8 leftover tokens


def test_golden_vectors_never_change() -> None:
    # If this fails, every cached block in every deployed index silently stops matching:
    # change the domain string ("halfmoon-kv/1") on purpose instead of changing the encoding.
    assert ROOT.hex() == GOLDEN_ROOT
    assert [h.hex() for h in block_hashes(TOKENS, 16, ROOT)] == GOLDEN_BLOCKS


def test_only_full_blocks_are_hashed_and_chained() -> None:
    hashes = block_hashes(TOKENS, 16, ROOT)
    assert len(hashes) == 2 and all(len(h) == HASH_BYTES for h in hashes)
    assert hashes[0] == chain_hash(ROOT, TOKENS[:16])
    assert hashes[1] == chain_hash(hashes[0], TOKENS[16:32])
    assert block_hashes(TOKENS[:15], 16, ROOT) == []


def test_same_block_after_a_different_prefix_hashes_differently() -> None:
    other = [99] + TOKENS[1:]
    assert block_hashes(other, 16, ROOT)[1] != block_hashes(TOKENS, 16, ROOT)[1]


def test_incremental_equals_from_scratch() -> None:
    first = block_hashes(TOKENS[:20], 16, ROOT)
    assert block_hashes(TOKENS, 16, ROOT, known=first) == block_hashes(TOKENS, 16, ROOT)


@pytest.mark.parametrize("change", [("fp-other", "float32", 16, None), ("fingerprint-abc", "bfloat16", 16, None),
                                    ("fingerprint-abc", "float32", 32, None),
                                    ("fingerprint-abc", "float32", 16, "tenant-b")])
def test_root_depends_on_every_field(change: tuple) -> None:
    assert root_hash(*change) != ROOT


def test_empty_salt_is_no_salt() -> None:
    assert root_hash("fingerprint-abc", "float32", 16, "") == ROOT


def test_same_hash_in_another_process() -> None:
    code = ("from halfmoon.kvpool.block_hash import root_hash, block_hashes;"
            "r = root_hash('fingerprint-abc', 'float32', 16);"
            "print(','.join(h.hex() for h in block_hashes(list(range(40)), 16, r)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": "", "PYTHONPATH": str(Path(__file__).parents[2])})
    assert out.stdout.strip().split(",") == GOLDEN_BLOCKS


GOLDEN_ROOT = "1b56db4a32e3d1f43ea91bf77a8961ae"
GOLDEN_BLOCKS = ["54f763e9fc395cf9301bd2a34cb33b6f", "7dbd30b2d0299ad9ce24e419487719af"]
