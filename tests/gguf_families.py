"""Tiny GGUFs of the family checkpoints (tests/model_families.py), written the way llama.cpp's
converter (convert_hf_to_gguf.py) writes them: its architecture names and metadata keys, its
tensor names, q/k rows permuted for the "llama" arch, Gemma's norms stored as 1 + w, Llama 3's
RoPE as a `rope_freqs` tensor of per-frequency divisors. Tensors are F32, so a loaded GGUF must
equal the HF folder it came from exactly.

What a GGUF cannot say is left out of the cases written here (`GGUF_CASES`): dynamic NTK (no
llama.cpp type), Qwen2's per-layer windows (llama.cpp ignores them) and a Gemma
query_pre_attn_scalar other than head_dim (llama.cpp derives it).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from tests.model_families import BY_NAME, FamilyCase

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}

# case -> (GGUF arch, the case as written: kwargs a GGUF can express)
GGUF_CASES: dict[str, tuple[str, FamilyCase]] = {
    "llama": ("llama", BY_NAME["llama"]),
    "llama-llama3-rope": ("llama", BY_NAME["llama-llama3-rope"]),
    "llama-linear-rope": ("llama", BY_NAME["llama-linear-rope"]),
    "llama-yarn-rope": ("llama", BY_NAME["llama-yarn-rope"]),
    "mistral": ("llama", BY_NAME["mistral"]),
    "qwen2": ("qwen2", dataclasses.replace(BY_NAME["qwen2"], kwargs={
        k: v for k, v in BY_NAME["qwen2"].kwargs.items() if k not in ("use_sliding_window", "sliding_window")})),
    "qwen3": ("qwen3", BY_NAME["qwen3"]),
    "gemma3": ("gemma3", dataclasses.replace(BY_NAME["gemma3"], kwargs={
        **BY_NAME["gemma3"].kwargs, "query_pre_attn_scalar": 32})),
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (HF rotate_half halves -> interleaved pairs)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensor_name(hf_name: str, arch: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    names = {**_HF_TO_GGUF, **_GEMMA_NORMS} if arch == "gemma3" else _HF_TO_GGUF
    return f"blk.{layer}.{names[module]}.{suffix}"


def llama3_rope_freqs(rope: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: the divisor of each frequency."""
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(model: Any, arch: str, path: Path, vocab: list[str]) -> Path:
    """The transformers `model`'s weights and config as llama.cpp writes them, F32, with the
    byte-level `vocab` (tokens 0..2 are <pad>, <s>, </s>)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    _write_metadata(w, cfg, arch)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(vocab)
    w.add_token_types([3, 3, 3] + [1] * (len(vocab) - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.detach().to(torch.float32).numpy().copy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            array = array + np.float32(1.0)  # llama.cpp stores Gemma's norms as 1 + w
        w.add_tensor(gguf_tensor_name(name, arch), array)
    rope = _rope_params(cfg)
    if rope and rope.get("rope_type") == "llama3":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, _theta(cfg), head_dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _rope_params(cfg: Any) -> dict[str, Any]:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return params.get("full_attention", params)


def _theta(cfg: Any) -> float:
    return float(_rope_params(cfg).get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)


def _write_metadata(w: gguf.GGUFWriter, cfg: Any, arch: str) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    rope = _rope_params(cfg)
    w.add_rope_freq_base(_theta(cfg))
    kind = rope.get("rope_type", "default")
    if kind in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType(kind))
        w.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if getattr(cfg, "sliding_window", None) and arch in ("llama", "gemma3"):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":  # the per-layer pattern (llama.cpp's own files rely on its every-6th default)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
