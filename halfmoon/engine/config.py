"""Engine configuration: frozen, typed, validated once at the boundary (CLI/YAML -> here)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from halfmoon.core.errors import ConfigError, check_positive
from halfmoon.core.logs import LogConfig
from halfmoon.core.tracing import TracingConfig
from halfmoon.transport.config import TransportConfig

if TYPE_CHECKING:
    import torch

# dtype names -> torch's attribute; torch is imported only when a dtype is asked for, so building a
# command line's flags from this config stays fast.
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
# `dtype="auto"` (serve's and profile's default): resolved once, where the config is built, by
# `auto_dtype` (so every worker of a cluster gets the Conductor's choice, never its own).
AUTO = "auto"
# Weight-only quantization of the dense layers (kernels/quant_linear.py): none, int8 per output
# channel, int4 in groups of 32 (a Q4_1 GGUF's own blocks, loaded without re-quantizing).
QUANTIZATIONS = ("none", "int8", "int4")
# Speculative decoding's draft sources (engine/speculative.py); `draft:MODEL` names a draft model
SPECULATIVE_MODES = ("off", "ngram")
DEVICES = ("cpu", "cuda")
DRAFT_PREFIX = "draft:"


def choose_dtype(device: str, onednn_bf16: bool) -> tuple[str, str]:
    """(dtype, why) for `dtype="auto"`: bf16 where its dense layers run a native bf16 GEMM (CUDA,
    or a CPU with oneDNN's bf16 path: AVX512-BW/VL/DQ, AVX512-BF16, AMX), fp32 elsewhere. Chosen
    from `halfmoon bench serve --defaults-compare` (docs/BENCHMARKS.md): bf16 served 1.46-1.59x
    fp32's goodput with oneDNN's bf16, 0.71x pooled without it (ATen and oneDNN capped at AVX2)."""
    if device == "cuda":
        return "bfloat16", "CUDA: bf16 is the device's serving precision"
    if onednn_bf16:
        return "bfloat16", "this CPU has oneDNN's bf16 path: bf16 serves the most goodput here"
    return "float32", ("this CPU has no oneDNN bf16 path (AVX2 only): bf16 serves less goodput than fp32 "
                       "here; --dtype bfloat16 forces it")


def auto_dtype(device: str) -> tuple[str, str]:
    """`choose_dtype` for this machine."""
    if device == "cuda":
        return choose_dtype(device, False)
    import torch

    # kernels/linear.py's test for its oneDNN bf16 kind, without its warning about the fallback
    # kind (an fp32 engine runs none): mkldnn in this build, and the CPU's bf16 path
    return choose_dtype(device, torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, DTYPES[name])


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything that shapes one engine instance.

    model: alias (`smollm2`), a GGUF file, or a HF folder (config.json + *.safetensors).
    dtype: compute and KV dtype, `float32` (this class's default: token-exact) or `bfloat16`;
        `auto` (serve's default) is resolved at construction by `auto_dtype`.
    quantization: weight-only quantization of the dense layers: `none`, `int8` (per output
        channel) or `int4` (groups of 32; a Q4_1 GGUF's own blocks); CPU only.
    block_size: tokens per KV block (the unit of paging, hashing and transfer).
    kv_cache_gb: KV cache size in GiB; ignored when `num_blocks` is set.
    num_blocks: KV cache size in blocks (overrides `kv_cache_gb`; tests use tiny pools).
    max_num_batched_tokens: token budget per step; prefills longer than this are chunked.
    max_num_seqs: most requests running at once.
    max_prefill_seqs: most requests computing prompt tokens in one step (None: as many as the
        budget takes); a prefill worker's comes from the cluster's `--prefill-max-seqs`.
    max_model_len: context limit (prompt + output); None = the model's own.
    num_threads: torch intra-op threads; None = leave torch's default.
    attention_backend: `torch` (CPU/CUDA) or `flashinfer` (CUDA only).
    host_cache_gb: host DRAM tier (shared-memory arena) in GiB; 0 = no host tier.
    host_cache_name: the node's arena name; workers of a node passing the same name share it
        (the first creates it). None = a private arena for this engine.
    disk_cache_dir: directory of the disk (NVMe) tier; None = no disk tier.
    disk_cache_gb: disk tier capacity in GiB.
    redis_url: the cluster-wide block index; None = no index (this engine's tiers only).
    worker_id / node_id: this engine's identity in the index (defaults: pid-based / hostname).
    remote_fetch: pull prefix blocks other workers hold (found in the index) over the KV
        transport; off = each worker reuses only its own tiers (the local-only baseline; its
        blocks are still served to workers that fetch).
    speculative: speculative decoding on decoding requests: `off`, `ngram` (prompt lookup:
        drafts what followed the latest earlier occurrence of the last tokens) or `draft:MODEL`
        (a draft model with the target's tokenizer drafts greedily; engine/draft_model.py).
        Greedy and seeded sampled output unchanged. engine/speculative.py.
    speculative_tokens: most tokens drafted per request and step (the policy picks fewer from
        each request's measured acceptance).
    speculative_max_batch: batch size from which speculation is off for the step; 0 = the
        crossover this engine measures from its own step times (engine/speculative.py StepCostTable).
    tp: tensor-parallel size: the engine spans this many processes, each with its share of
        the heads, MLP and vocabulary and its KV heads (engine/parallel.py); 1 = one process.
        CPU (gloo) only for now. Its tier records and index entries hold every rank's shard
        of a block, under hashes rooted in the layout (`kv_tag`; kvpool/tiered.py).
    device: where the model and its KV cache live: `cpu` or `cuda` (the process's current GPU;
        `serve` gives each worker one, or a share of one: conductor/gpu_plan.py).
    cuda_graphs: on CUDA, capture decode steps as CUDA graphs at start-up, one per
        (batch, context) bucket, and replay them (engine/cuda_graphs.py); with speculation,
        verification steps too, one per (requests, rows per request, context) bucket; prefill
        and mixed steps run eagerly. Ignored on CPU.
    gpu_memory_fraction: the share of the GPU's memory this process may allocate (0 = no cap;
        `serve` sets an equal share when workers share one GPU).
    max_loras: LoRA adapter slots (engine/lora_pool.py): the most distinct adapters one step
        serves; their memory is allocated at the first adapter a request names.
    max_lora_rank: the largest adapter rank served (the slots' size).
    max_cpu_loras: adapters kept read and checked in host memory (>= max_loras).
    lora_base_check: refuse an adapter whose `base_model_name_or_path` names another model.
    """

    model: str = "smollm2"
    dtype: str = "float32"
    quantization: str = "none"
    block_size: int = 16
    kv_cache_gb: float = 1.0
    num_blocks: int | None = None
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_prefill_seqs: int | None = None
    max_model_len: int | None = None
    num_threads: int | None = None
    attention_backend: str = "torch"
    host_cache_gb: float = 0.0
    host_cache_name: str | None = None
    disk_cache_dir: str | None = None
    disk_cache_gb: float = 0.0
    redis_url: str | None = None
    worker_id: str | None = None
    node_id: str | None = None
    remote_fetch: bool = True
    speculative: str = "off"
    speculative_tokens: int = 6
    speculative_max_batch: int = 0
    tp: int = 1
    device: str = "cpu"
    cuda_graphs: bool = True
    gpu_memory_fraction: float = 0.0
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int = 16
    lora_base_check: bool = True

    def __post_init__(self) -> None:
        if self.dtype == AUTO:  # resolved here, once: the config carries the concrete dtype from now on
            object.__setattr__(self, "dtype", auto_dtype(self.device)[0])
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} not supported; choose from {[AUTO, *sorted(DTYPES)]}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization {self.quantization!r} not supported; choose from {list(QUANTIZATIONS)}")
        check_positive(self, "block_size", "max_num_batched_tokens", "max_num_seqs", "num_blocks", "num_threads", "tp",
                       "max_prefill_seqs")
        if self.num_blocks is None and self.kv_cache_gb <= 0:
            raise ConfigError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ConfigError(f"max_model_len must be > 1, got {self.max_model_len}")
        if self.host_cache_gb < 0 or self.disk_cache_gb < 0:
            raise ConfigError("host_cache_gb and disk_cache_gb must be >= 0")
        if self.disk_cache_dir is not None and self.disk_cache_gb <= 0:
            raise ConfigError("disk_cache_dir is set but disk_cache_gb is 0")
        draft = self.speculative.startswith(DRAFT_PREFIX) and len(self.speculative) > len(DRAFT_PREFIX)
        if self.speculative not in SPECULATIVE_MODES and not draft:
            raise ConfigError(f"speculative {self.speculative!r} not supported; choose from "
                              f"{list(SPECULATIVE_MODES)} or {DRAFT_PREFIX}MODEL (an alias, GGUF file or HF folder)")
        if not 1 <= self.speculative_tokens <= 16 or self.speculative_max_batch < 0:
            raise ConfigError("speculative_tokens must be in 1..16 and speculative_max_batch >= 0")
        check_positive(self, "max_loras", "max_lora_rank")
        if self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        self._check_device()

    def _check_device(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"device {self.device!r} not supported; choose from {list(DEVICES)}")
        if not 0.0 <= self.gpu_memory_fraction <= 1.0:
            raise ConfigError(f"gpu_memory_fraction must be in [0, 1], got {self.gpu_memory_fraction}")
        if self.device == "cuda" and self.quantization != "none":
            raise ConfigError(f"quantization {self.quantization!r} runs on CPU only; use --quantization none "
                              "with --device cuda")
        if self.device == "cuda" and self.tp > 1:
            raise ConfigError("tp > 1 runs on CPU (gloo) only; use --tp 1 with --device cuda")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def kv_tag(self) -> str:
        """What, besides the model, shapes a KV block's contents: the dtype, and the weights'
        quantization when there is one (an int4 engine's KV is not an fp32 engine's), and the
        tensor-parallel size when > 1. Part of every block hash's root, so engines that differ
        here never share a block."""
        dtype = DTYPES[self.dtype]  # "bf16" and "bfloat16" hash alike
        tag = dtype if self.quantization == "none" else f"{dtype}+{self.quantization}"
        # a tensor-parallel engine's blocks are per-rank shards: never matched across layouts
        return tag if self.tp == 1 else f"{tag}+tp{self.tp}"


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker: its identity, engine, transport, and the CPU cores it may use.

    worker_id: unique in the cluster; the Ray actor's name and the holder id in the index.
    cpus: cores to pin this worker's threads to (None = no pinning); torch gets one thread
        per core unless `engine.num_threads` says otherwise.
    tracing: the Conductor's tracing, resolved there (the OTEL_* environment of the Conductor
        holds on every node).
    log: how the worker logs (as the Conductor).
    """

    worker_id: str
    role: str  # "prefill" | "decode"
    engine: EngineConfig
    transport: TransportConfig = field(default_factory=TransportConfig)
    cpus: tuple[int, ...] | None = None
    node_id: str = "local"
    tracing: TracingConfig = field(default_factory=TracingConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def engine_config(self) -> EngineConfig:
        threads = self.engine.num_threads or (len(self.cpus) if self.cpus else None)
        return dataclasses.replace(self.engine, worker_id=self.worker_id, node_id=self.node_id,
                                   num_threads=threads)
