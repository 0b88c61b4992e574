"""The architecture of a loaded model: what the runtime needs to know, read once from the file.

One `ModelConfig` describes every supported family (engine/families.py parses it from a HF
`config.json` or GGUF metadata): the shapes, and the handful of switches in which the families'
decoder layers differ. The defaults are Llama's, so a Llama config names none of them:

    switch               Llama / Mistral   Qwen2 / 2.5   Qwen3      Gemma 3
    attention_bias       -                 q/k/v bias    -          -
    qk_norm              -                 -             RMSNorm    RMSNorm
    sandwich_norms       -                 -             -          post-attn / pre+post-FFN norms
    activation           silu              silu          silu       gelu_tanh
    embed_scale          1                 1             1          sqrt(hidden)
    query_scale          head_dim^-0.5     ...           ...        query_pre_attn_scalar^-0.5
    layer_windows        Mistral: W        sliding layers            5 local (W) : 1 global
    local_rope           -                 -             -          its own base (10k)
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """One RoPE: its base and scaling (HF `rope_parameters` / `rope_scaling`, resolved).

    kind: default | linear | dynamic | yarn | llama3 (engine/rope.py computes each as HF does).
    factor: the scaling factor (1 for default). original_max_position: the pre-extension context
    (llama3, yarn; dynamic scales past `max_position_embeddings`, kept here too).
    attention_factor: yarn's cos/sin multiplier, resolved at parse time (1 for the others).
    """

    theta: float
    kind: str = "default"
    factor: float = 1.0
    original_max_position: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ROPE_TYPES:
            raise ValueError(f"unknown rope type {self.kind!r} (supported: {', '.join(ROPE_TYPES)})")
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError(f"rope theta {self.theta} and factor {self.factor} must be positive")

    @property
    def dynamic(self) -> bool:
        return self.kind == "dynamic"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A decoder-only transformer's hyperparameters, from GGUF metadata or a HF `config.json`.

    `architecture` is the family (engine/families.py: llama, mistral, qwen2, qwen3, gemma3).
    """

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    bos_id: int | None
    eos_id: int
    # Identifies the weights (name + size of the source), part of every block hash (docs/ARCHITECTURE.md, "Block identity").
    source_id: str = ""
    # --- family switches (module docstring); defaults are Llama's
    rope_scaling: RopeSpec | None = None  # the global layers' RoPE when it is not plain `rope_theta`
    local_rope_theta: float | None = None  # sliding layers' own plain RoPE base (Gemma 3); None: the global RoPE
    layer_windows: tuple[int, ...] = ()  # per layer: 0 = full attention, W = sliding window of W tokens; () = all full
    attention_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    activation: str = "silu"
    embed_scale: float = 1.0
    query_scale: float | None = None  # None: head_dim ** -0.5
    final_logit_softcap: float | None = None
    extra_eos_ids: tuple[int, ...] = ()  # generation_config's other stop ids (e.g. Llama 3's <|eot_id|>)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of kv heads {self.num_kv_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} not supported ({', '.join(ACTIVATIONS)})")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")
        if any(w < 0 for w in self.layer_windows):
            raise ValueError(f"negative sliding window in {self.layer_windows}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def global_rope(self) -> RopeSpec:
        return self.rope_scaling or RopeSpec(self.rope_theta)

    @property
    def local_rope(self) -> RopeSpec:
        """The RoPE of sliding-window layers."""
        return RopeSpec(self.local_rope_theta) if self.local_rope_theta is not None else self.global_rope

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in tokens; 0 = it sees the whole context."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def max_window(self) -> int:
        """0 when some layer sees the whole context, else the widest window."""
        windows = [self.window(i) for i in range(self.num_layers)]
        return 0 if 0 in windows else max(windows)

    @property
    def attention_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim ** -0.5

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eos_id, *(i for i in self.extra_eos_ids if i != self.eos_id))

    @property
    def fingerprint(self) -> str:
        """Stable sha256 (hex, 16 bytes) over the canonical JSON of this config (family included)."""
        blob = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    def num_parameters(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_layers
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        norms = (4 if self.sandwich_norms else 2) * h + (2 * self.head_dim if self.qk_norm else 0)
        per_layer = attn + 3 * h * i + norms
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + layers * per_layer + h + head


def yarn_attention_factor(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """YaRN's cos/sin multiplier when the config does not give one (HF's `get_mscale`)."""
    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(get(factor, mscale) / get(factor, mscale_all_dim))
    return get(factor)
