"""The architecture of a loaded model: what the runtime needs to know, read once from the file."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Llama-family hyperparameters, from GGUF metadata or a HF `config.json`."""

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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of kv heads {self.num_kv_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def fingerprint(self) -> str:
        """Stable sha256 (hex, 16 bytes) over the canonical JSON of this config."""
        blob = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    def num_parameters(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_layers
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + layers * per_layer + h + head
