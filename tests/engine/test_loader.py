"""Loading: a HF folder (config.json + safetensors + tokenizer.json) serves exactly like the GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.engine.loader import LoadedWeights, load_weights
from halfmoon.kernels.linear import BF16_DENSE_MIN_ROWS, auto_kind
from halfmoon.core.params import SamplingParams
from tests.conftest import NUM_THREADS


def write_hf_folder(weights: LoadedWeights, engine: Engine, folder: Path) -> None:
    """The GGUF's tensors, config and tokenizer re-saved the way a HF checkpoint lays them out."""
    cfg = weights.config
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in weights.weights.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position, "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id,
    }))
    tok = engine.tokenizer
    tok._backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tok._backend.id_to_token(tok.bos_id), "eos_token": tok._backend.id_to_token(tok.eos_id),
        "add_bos_token": tok.add_bos, "chat_template": tok.chat_template,
    }))


@pytest.mark.timeout(300)
def test_hf_folder_gives_the_same_tokens_as_the_gguf(engine: Engine, smollm2_weights: LoadedWeights,
                                                      tmp_path: Path) -> None:
    folder = tmp_path / "smollm2-hf"
    write_hf_folder(smollm2_weights, engine, folder)
    hf_engine = Engine(EngineConfig(model=str(folder), num_blocks=64, num_threads=NUM_THREADS))
    assert hf_engine.model_config.num_layers == engine.model_config.num_layers
    prompt = "def fibonacci(n):"
    ids = engine.tokenizer.encode(prompt)
    assert hf_engine.tokenizer.encode(prompt) == ids
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    assert hf_engine.generate([ids], params)[0].output_ids == engine.generate([ids], params)[0].output_ids


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What llama.cpp's converter does to HF q_proj/k_proj rows (its rope layout)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("name,heads_attr", [("attn_q", "num_heads"), ("attn_k", "num_kv_heads")])
def test_gguf_q_and_k_are_unpermuted_to_hf_layout(smollm2_weights: LoadedWeights, name: str,
                                                  heads_attr: str) -> None:
    from halfmoon.engine.loader import _dequantize, open_gguf  # noqa: PLC0415

    reader = open_gguf(smollm2_weights.path)
    raw = next(t for t in reader.tensors if t.name == f"blk.3.{name}.weight")
    raw_w = torch.from_numpy(_dequantize(raw, smollm2_weights.path).copy())
    proj = {"attn_q": "q_proj", "attn_k": "k_proj"}[name]
    ours = smollm2_weights.weights[f"model.layers.3.self_attn.{proj}.weight"]
    assert not torch.equal(ours, raw_w)  # the permutation was undone, not skipped
    n_head = getattr(smollm2_weights.config, heads_attr)
    assert torch.equal(_llama_cpp_permute(ours, n_head), raw_w)


@pytest.mark.timeout(300)
def test_bf16_is_selectable_and_agrees_with_fp32_on_a_clear_prompt() -> None:
    engine_bf16 = Engine(EngineConfig(dtype="bfloat16", num_blocks=32, num_threads=NUM_THREADS))
    assert engine_bf16.kv_cache.dtype == torch.bfloat16
    ids = engine_bf16.tokenizer.encode("The capital of France is")
    out = engine_bf16.generate([ids], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert out.output_ids[:2] == [7042, 30]  # " Paris." as in fp32 and transformers
    model = engine_bf16.model
    kind = auto_kind(model.embed)  # "bf16-native" on a CPU without oneDNN bf16 (kernels/linear.py)
    layers = [d for lw in model.layers for d in (lw.qkv, lw.o, lw.gate_up, lw.down)]
    assert {d.kind for d in [*layers, model.lm_head]} == {kind}
    # a batch decoding BF16_DENSE_MIN_ROWS rows at once: a "bf16-native" layer's fp32 copy
    batch = engine_bf16.generate([ids] * BF16_DENSE_MIN_ROWS, SamplingParams(max_tokens=2, ignore_eos=True))
    assert all(o.output_ids == [7042, 30] for o in batch)


def test_load_weights_rejects_a_folder_without_safetensors(tmp_path: Path) -> None:
    from halfmoon.engine.errors import ModelLoadError  # noqa: PLC0415

    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 2,
                                                    "hidden_size": 8, "num_hidden_layers": 1,
                                                    "intermediate_size": 8, "vocab_size": 10}))
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_weights(str(folder))
