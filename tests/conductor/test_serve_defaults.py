"""conductor/serve_defaults.py: serve's engine at the defaults, and its tiers cut into whole blocks
of a model's KV bytes per token as the engine cuts them (tests/sim/test_serve_defaults.py holds
`halfmoon sim`'s defaults to these)."""

from __future__ import annotations

import dataclasses

import pytest

from halfmoon.conductor.serve_defaults import (HOST_CACHE_GB, SERVE_DTYPE, SERVE_QUANTIZATION, TierTokens, gib_for_tokens,
                                      serve_cluster, serve_engine, tier_tokens)
from halfmoon.engine.config import EngineConfig, auto_dtype

SMOLLM2_FP32 = 30 * 2 * 3 * 64 * 4  # layers x (K, V) x KV heads x head dim x fp32 bytes


def test_serve_runs_the_engine_defaults_plus_a_host_tier_in_its_own_precision() -> None:
    """Serve's engine differs from the engine commands' only in a host tier and `--dtype auto`
    (resolved on this machine: bf16 with oneDNN's bf16 path, else fp32); unquantized alike."""
    assert serve_engine() == dataclasses.replace(EngineConfig(), host_cache_gb=HOST_CACHE_GB,
                                                 dtype=auto_dtype("cpu")[0]) != EngineConfig()
    assert (SERVE_DTYPE, SERVE_QUANTIZATION, EngineConfig().dtype) == ("auto", "none", "float32")
    assert serve_cluster().engine == serve_engine() and serve_engine().disk_cache_dir is None


def test_tiers_are_whole_engine_blocks_of_the_configured_bytes() -> None:
    # this machine's SmolLM2 in fp32: 46080 B a token, 737280 B a 16-token block
    tiers = tier_tokens(serve_cluster().engine, SMOLLM2_FP32)
    assert tiers == TierTokens(2**30 // 737280 * 16, int(HOST_CACHE_GB * 2**30) // 737280 * 16, 0)
    assert tiers == (23296, 93200, 0)
    disk = dataclasses.replace(EngineConfig(), num_blocks=100, disk_cache_dir="/d", disk_cache_gb=0.001)
    assert tier_tokens(disk, SMOLLM2_FP32) == (1600, 0, 16)  # a tier that is on holds >= one block
    assert gib_for_tokens(tiers.host, SMOLLM2_FP32) == pytest.approx(HOST_CACHE_GB, rel=1e-3)
    with pytest.raises(ValueError):
        tier_tokens(EngineConfig(), 0)
