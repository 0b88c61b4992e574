"""Tiny random-weight checkpoints of every supported family, built with transformers.

Each `FamilyCase` is a HF config small enough to run in a second, chosen so that what makes the
family different is exercised by the prompts the tests use (`PROMPT_LEN` tokens, then `NEW`
generated): sliding windows shorter than the prompt and not a multiple of the 16-token block,
rope scaling whose frequencies differ from plain RoPE at the positions reached (dynamic NTK past
`max_position_embeddings`), q/k/v biases, q/k norms, an explicit head_dim, Gemma's sandwich
norms, scaled embeddings, local/global RoPE bases and query_pre_attn_scalar.

`build_checkpoint(case, folder)` writes `save_pretrained`'s folder (config.json, safetensors,
generation_config.json) plus a byte-level tokenizer.json, with weights drawn at scales that make
greedy decoding decisive (logits spread over a few units, so fp32 rounding never flips a token).
`hf_greedy` is the oracle: transformers' own `generate`, fp32, eager attention.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

VOCAB = 384
PROMPT_LEN = 40
NEW = 64
SEED = 1234


@dataclass(frozen=True)
class FamilyCase:
    name: str
    config_cls: str  # transformers class names
    model_cls: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    gemma_norms: bool = False  # norm weights are applied as (1 + w): draw w around 0

    def __str__(self) -> str:  # pytest ids
        return self.name


_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             tie_word_embeddings=False)

CASES: tuple[FamilyCase, ...] = (
    FamilyCase("llama", "LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    FamilyCase("llama-llama3-rope", "LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        rope_theta=500000.0)),
    FamilyCase("llama-linear-rope", "LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # dynamic NTK only changes anything past max_position_embeddings: 40 + 64 tokens reach 104
    FamilyCase("llama-dynamic-rope", "LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=64)),
    FamilyCase("llama-yarn-rope", "LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        max_position_embeddings=256)),
    FamilyCase("mistral", "MistralConfig", "MistralForCausalLM", dict(sliding_window=20, head_dim=16)),
    FamilyCase("qwen2", "Qwen2Config", "Qwen2ForCausalLM", dict(
        use_sliding_window=True, sliding_window=24, max_window_layers=1,
        rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128})),
    # explicit head_dim: 4 heads x 32 != hidden 64
    FamilyCase("qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, num_key_value_heads=1)),
    FamilyCase("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=4, head_dim=32, sliding_window=20, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}},
        tie_word_embeddings=True), gemma_norms=True),
)
BY_NAME = {c.name: c for c in CASES}


def hf_model(case: FamilyCase) -> Any:
    """The case's transformers model with decisive random weights, fp32, eager attention."""
    import transformers

    config = getattr(transformers, case.config_cls)(**{**_BASE, **case.kwargs})
    config._attn_implementation = "eager"
    model = getattr(transformers, case.model_cls)(config)
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_draw(name, p.shape, case, g))
    return model.eval()


def _draw(name: str, shape: torch.Size, case: FamilyCase, g: torch.Generator) -> torch.Tensor:
    def normal(std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    if "norm" in name:
        return normal(0.1) if case.gemma_norms else 1.0 + normal(0.1)
    if name.endswith(".bias"):
        return normal(0.2)
    if "embed_tokens" in name:
        return normal(1.0 if not case.gemma_norms else 0.125)  # Gemma scales by sqrt(hidden)
    if "lm_head" in name:
        return normal(4.0 / shape[1] ** 0.5)
    if "q_proj" in name or "k_proj" in name:
        return normal(0.15)
    return normal(shape[1] ** -0.5)


def build_checkpoint(case: FamilyCase, folder: Path) -> Any:
    """Writes the case's HF folder; returns the transformers model it holds."""
    model = hf_model(case)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return model


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE over the 256 bytes, no merges, padded with `<t{i}>` tokens to VOCAB."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from halfmoon.engine.tokenizer import _BYTE_TO_CHAR

    specials = ["<pad>", "<s>", "</s>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for b in range(256):
        vocab[_BYTE_TO_CHAR[b]] = len(vocab)
    while len(vocab) < VOCAB:
        vocab[f"<t{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}))


def prompts(n: int = 2, length: int = PROMPT_LEN) -> list[list[int]]:
    g = torch.Generator().manual_seed(SEED + 7)
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for _ in range(n)]


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], new: int = NEW) -> list[int]:
    """transformers' own greedy generate (its KV cache, its dynamic RoPE), eos ignored."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
