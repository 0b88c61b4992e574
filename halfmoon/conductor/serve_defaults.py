"""What `halfmoon serve` runs when no flag says otherwise, in one place.

`serve`'s flags (cli/components.py) and `halfmoon sim`'s (cli/sim.py, through
`sim.cluster.serve_config`) both read this module, so a simulation given no shape or tier flag is
the cluster `serve` starts (tests/sim/test_serve_defaults.py parses both command lines and holds
them equal). The engine's own dataclass defaults (`EngineConfig`) are those of the one-request
engine commands (`generate`, `profile`); serve's engine differs from them only where named here.

A tier's size in tokens depends on the model: serve sizes its tiers in GiB (`--kv-cache-gb`,
`--host-cache-gb`, `--disk-cache-gb`), the engine cuts them into whole blocks of
`block_size x kv_bytes_per_token` bytes (engine/engine.py: the device pool and `build_tiers`'
slots), and `tier_tokens` does the same arithmetic for any model's KV bytes per token (a cost
model's `kv_bytes_per_token`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from halfmoon.conductor.admission import AdmissionConfig
from halfmoon.conductor.cluster_config import ClusterConfig
from halfmoon.conductor.planner import PlannerConfig
from halfmoon.engine.config import AUTO, DTYPES, EngineConfig, auto_dtype

# `serve` keeps a host DRAM tier by default (vLLM's --swap-space and SGLang's hierarchical cache
# do alike): blocks the device tier evicts spill there and are hits again. One arena per node,
# shared by the node's workers (one worker per node in the Helm chart's pods).
HOST_CACHE_GB = 4.0
GIB = 2**30

# `serve`'s precision: `auto` = bf16 where its dense layers have a native bf16 GEMM (CUDA, or a
# CPU with oneDNN's bf16 path), fp32 elsewhere (engine/config.py `choose_dtype`), weights
# unquantized. Of the precisions the engine offers that is the most goodput on the same 1P1D
# replay (`halfmoon bench serve --defaults-compare`, docs/BENCHMARKS.md): on an AVX-512 + bf16
# CPU bf16 served 1.46-1.59x fp32's goodput, ahead of bf16 + int8 / int4, whose prefill runs a
# dequantized fp32 copy; with oneDNN and ATen capped at AVX2, bf16 served 0.71x fp32's (pooled
# over two runs). Its quality stays within the quantization bounds against fp32
# (engine/quality.py; tests/engine/test_serve_precision.py). `--dtype float32 --quantization
# none` is the token-exact mode: fp32 greedy output equals transformers', and the tests that
# compare tokens ask for it (`EXACT_FLAGS`). `generate` keeps `EngineConfig`'s fp32.
SERVE_DTYPE = AUTO

# A prefill worker's engine steps one prompt at a time (`--prefill-max-seqs`): every prompt of a
# step gets its first token at the step's end, so a burst packed into 512-token steps finishes
# together, later than shortest-first one at a time; the steps' constant is small beside a
# prompt's tokens (CPU: 27-35 ms against ~1-2 ms a token). Simulated on the bursty traces
# (seeds 0-2, 1P1D, this machine's fp32 profile, window 20 ms): 95-100% of the offline optimum
# one a step against 65-75% batched (docs/BENCHMARKS.md, issue 38).
SERVE_PREFILL_MAX_SEQS = 1
SERVE_QUANTIZATION = "none"
EXACT_FLAGS = ("--dtype", "float32", "--quantization", "none")


def serve_engine() -> EngineConfig:
    """The engine every `serve` worker runs at the defaults, its dtype resolved on this machine
    (no disk tier: it needs a directory)."""
    return dataclasses.replace(EngineConfig(), host_cache_gb=HOST_CACHE_GB, dtype=SERVE_DTYPE,
                               quantization=SERVE_QUANTIZATION)


def precision_line(dtype: str, quantization: str, device: str = "cpu") -> str:
    """What `serve` says at start about its precision: what `auto` chose and why, or that it was asked."""
    if dtype == AUTO:
        chosen, why = auto_dtype(device)
        return (f"precision {chosen}, quantization {quantization} (--dtype auto: {why}; token-exact: "
                + " ".join(EXACT_FLAGS) + ")")
    exact = "the token-exact mode, greedy output equals transformers'; " if (DTYPES[dtype], quantization) == (
        "float32", "none") else ""
    return f"precision {DTYPES[dtype]}, quantization {quantization} (asked: {exact}serve's default is --dtype auto)"


def serve_cluster() -> ClusterConfig:
    """The cluster `serve` starts at the defaults: its shape and each worker's engine."""
    return dataclasses.replace(ClusterConfig(), engine=serve_engine(), prefill_max_seqs=SERVE_PREFILL_MAX_SEQS,
                               planner=PlannerConfig())  # serve's planner advises (a ClusterConfig's has none)


def serve_shape() -> ClusterConfig:
    """`serve_cluster()` but for its engine's dtype: the engine's own default rather than `auto`
    resolved on this machine. What the simulator needs: no simulated figure depends on the
    precision (a cost model carries it), and resolving it imports torch, seconds before every
    `halfmoon sim` answers (tests/sim/test_serve_defaults.py holds the rest equal)."""
    engine = dataclasses.replace(EngineConfig(), host_cache_gb=HOST_CACHE_GB, quantization=SERVE_QUANTIZATION)
    return dataclasses.replace(ClusterConfig(), engine=engine, prefill_max_seqs=SERVE_PREFILL_MAX_SEQS,
                               planner=PlannerConfig())


def serve_admission() -> AdmissionConfig:
    """The Conductor's admission policy and class SLOs at the defaults."""
    return AdmissionConfig()


class TierTokens(NamedTuple):
    """One worker's KV tiers in tokens (whole engine blocks); 0 = no such tier."""

    device: int
    host: int
    disk: int


def tier_tokens(engine: EngineConfig, kv_bytes_per_token: int) -> TierTokens:
    """`engine`'s tiers in tokens for a model whose KV is `kv_bytes_per_token` (all layers, K and
    V): whole blocks of `block_size` tokens, as the engine sizes them."""
    if kv_bytes_per_token <= 0:
        raise ValueError(f"kv_bytes_per_token must be > 0, got {kv_bytes_per_token}")
    block_bytes = kv_bytes_per_token * engine.block_size
    device = engine.num_blocks or max(1, int(engine.kv_cache_gb * GIB) // block_bytes)
    host = _slots(engine.host_cache_gb, block_bytes)
    disk = _slots(engine.disk_cache_gb, block_bytes) if engine.disk_cache_dir is not None else 0
    return TierTokens(device * engine.block_size, host * engine.block_size, disk * engine.block_size)


def _slots(gib: float, block_bytes: int) -> int:
    """Blocks of a host or disk tier of `gib` GiB (at least one when on: build_tiers' rule)."""
    return max(1, int(gib * GIB) // block_bytes) if gib > 0 else 0


def gib_for_tokens(tokens: int, kv_bytes_per_token: int) -> float:
    """The GiB a tier needs to hold `tokens` tokens' KV (the inverse of `tier_tokens`)."""
    return tokens * kv_bytes_per_token / GIB
