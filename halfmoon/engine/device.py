"""Where an engine runs: the device check, the GPU memory share, weights placement, the
factory-call scope, and the decode and speculative verification CUDA graphs.

An engine on CUDA builds its KV cache, RoPE tables and step buffers with factory calls on
torch's default device, so construction and every step run inside `scope(device)`
(`torch.device` as a context manager: per thread, nothing global). Weights are loaded on the
host and moved once. Workers sharing one GPU each cap their allocator at their share
(`gpu_memory_fraction`, set by `serve`'s GPU plan: conductor/gpu_plan.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import ContextManager

import torch

from halfmoon.core.errors import ConfigError
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.cuda_graphs import (MAX_GRAPH_BATCH, MAX_VERIFY_BATCH, CudaGraphCapture, DecodeGraphs, GraphCapture,
                                VerifyGraphs, graph_ctx_limit)
from halfmoon.engine.loader import LoadedWeights
from halfmoon.engine.speculative import SpeculativeConfig
from halfmoon.kvpool.device_tier import DeviceBudget

log = logging.getLogger(__name__)


def open_device(config: EngineConfig) -> torch.device:
    """The engine's device, checked; on CUDA its memory share applied (ConfigError when there is
    no CUDA device: the message says what to do)."""
    if config.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda: this process sees no CUDA device (check the driver, "
                          "CUDA_VISIBLE_DEVICES and the worker's GPU request), or use --device cpu")
    device = torch.device("cuda", torch.cuda.current_device())
    if config.gpu_memory_fraction > 0:
        torch.cuda.set_per_process_memory_fraction(config.gpu_memory_fraction, device)
    return device


def scope(device: torch.device) -> ContextManager[object]:
    """Factory calls without a device land on `device` inside this scope (a no-op on CPU)."""
    return contextlib.nullcontext() if device.type == "cpu" else device


def place_weights(weights: LoadedWeights, device: torch.device) -> LoadedWeights:
    """The loaded weights on `device` (the same object on CPU)."""
    if device.type == "cpu":
        return weights
    moved = {name: t.to(device, non_blocking=True) for name, t in weights.weights.items()}
    return dataclasses.replace(weights, weights=moved)


def check_kv_fits(device: torch.device, fraction: float, weights: LoadedWeights, kv_bytes: int) -> None:
    """On CUDA, ConfigError unless a KV tier of `kv_bytes` fits this worker's share of the GPU
    beside its weights (kvpool/device_tier.py); nothing to check on CPU."""
    if device.type != "cuda":
        return
    weights_bytes = sum(t.numel() * t.element_size() for t in weights.weights.values())
    total = torch.cuda.get_device_properties(device).total_memory
    DeviceBudget(total, fraction, weights_bytes).check(kv_bytes)


def kv_blocks_with_pad(num_blocks: int, config: EngineConfig) -> int:
    """Blocks of the KV tensor: the pool's, plus one pad block when decode graphs may run (their
    padding rows write there, never into a request's block)."""
    return num_blocks + 1 if graphs_wanted(config) else num_blocks


def graphs_wanted(config: EngineConfig) -> bool:
    """Graphs on CUDA with the torch backend. FlashInfer plans its page tables on the host each
    step (kernels/flashinfer_backend.py): a captured plan would replay stale tables, so a
    flashinfer engine runs every step eagerly until its CUDA-graph wrappers are wired in."""
    return config.device == "cuda" and config.cuda_graphs and config.attention_backend == "torch"


def build_graphs(config: EngineConfig, forward: Callable[..., torch.Tensor], kv_cache: torch.Tensor, pad_block: int,
                 max_model_len: int, windows: Sequence[int],
                 capture: GraphCapture | None = None) -> DecodeGraphs | None:
    """The decode graphs, captured now (start-up); None when off (flag, CPU). `capture`: the
    recorder (default: CUDA graphs; the CPU tests pass a fake). `pad_block`: a KV block no
    request owns, where padding rows write."""
    if capture is None:
        if not graphs_wanted(config):
            return None
        capture = CudaGraphCapture()
    max_batch = min(config.max_num_seqs, config.max_num_batched_tokens, MAX_GRAPH_BATCH)
    top = graph_ctx_limit(max_model_len, windows, config.block_size)
    if top == 0:
        log.warning("decode CUDA graphs off: a sliding window under one block (%d tokens)", config.block_size)
        return None
    graphs = DecodeGraphs(forward, kv_cache, pad_block, max_batch, top, capture)
    graphs.capture()
    log.info("captured %d decode CUDA graphs (batch %s x context %s)", len(graphs.graphs),
             list(graphs.rows), list(graphs.ctxs))
    return graphs


def build_verify_graphs(config: EngineConfig, forward: Callable[..., torch.Tensor], kv_cache: torch.Tensor,
                        pad_block: int, max_model_len: int, windows: Sequence[int],
                        capture: GraphCapture) -> VerifyGraphs | None:
    """The speculative verification graphs, captured now through `capture`; None when
    speculation is off. Requests up to the batch from which speculation turns off (or
    MAX_VERIFY_BATCH), rows per request up to 1 + speculative_tokens."""
    spec = SpeculativeConfig.of(config)
    most = min(config.max_num_seqs, MAX_VERIFY_BATCH, spec.max_batch - 1 if spec.max_batch else MAX_VERIFY_BATCH)
    top = graph_ctx_limit(max_model_len, windows, config.block_size)
    if not spec.enabled or most < 1 or top == 0:
        return None
    graphs = VerifyGraphs(forward, kv_cache, pad_block, most, spec.max_draft, top, capture).capture()
    log.info("captured %d verification CUDA graphs (requests %s x rows %s x context %s)", len(graphs.graphs),
             list(graphs.requests), list(graphs.queries), list(graphs.ctxs))
    return graphs


def build_step_graphs(config: EngineConfig, forward: Callable[..., torch.Tensor], kv_cache: torch.Tensor,
                      pad_block: int, max_model_len: int, windows: Sequence[int],
                      capture: GraphCapture | None = None) -> tuple[DecodeGraphs | None, VerifyGraphs | None]:
    """Decode graphs and, with speculation, verification graphs, captured at start-up through
    one recorder (on CUDA one memory pool: the activations take the largest graph's memory);
    (None, None) when graphs are off (`cuda_graphs`, CPU, flashinfer). `capture`: as in
    `build_graphs` (the CPU tests pass a fake)."""
    if capture is None:
        if not graphs_wanted(config):
            return None, None
        capture = CudaGraphCapture()
    return (build_graphs(config, forward, kv_cache, pad_block, max_model_len, windows, capture),
            build_verify_graphs(config, forward, kv_cache, pad_block, max_model_len, windows, capture))
