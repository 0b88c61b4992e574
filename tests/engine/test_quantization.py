"""`--quantization int8|int4` on the real SmolLM2 weights: the source's own 4-bit blocks, and the
quality bounds of issue 23 against the fp32 engine.

Measured here (1 thread, engine/quality.py's text of 191 tokens and 8 prompts, 16 greedy
tokens each): perplexity fp32 28.58; int8 +0.56%, int4 +0.40% (its lm head is int8: the tied
embedding is Q8_0 in the file, no 4-bit source). The first greedy token equals fp32's on 8/8
prompts for both; over 16 tokens the matching prefixes cover 59% (int8) and 63% (int4) of the
tokens, where bf16 without quantization covers about the same: near-tied logits flip, and a
greedy path never rejoins. So the bounds asserted are the issue's perplexity bounds, every first
token, and half of the tokens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest import mock

import pytest
import torch

import engine.engine as engine_module
from core.errors import ConfigError
from engine import quality
from engine.config import EngineConfig
from engine.engine import Engine
from engine.loader import LoadedWeights, read_q4_1
from kernels.quant_linear import Int4Linear, Int8Linear

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PERPLEXITY_BOUND = {"int8": 0.01, "int4": 0.03}
MIN_TOKEN_AGREEMENT = 0.5
GREEDY_TOKENS = 16


@pytest.fixture(scope="module")
def q4_weights(smollm2_weights: LoadedWeights, gguf_path: Path) -> LoadedWeights:
    q4 = read_q4_1(gguf_path, smollm2_weights.gguf_reader, smollm2_weights.config)
    return dataclasses.replace(smollm2_weights, q4=q4)


def build(weights: LoadedWeights, quantization: str) -> Engine:
    config = EngineConfig(model="smollm2", quantization=quantization, num_blocks=32, num_threads=1)
    with mock.patch.object(engine_module, "load_weights", return_value=weights):
        return Engine(config)


@pytest.fixture(scope="module")
def reference(shared_engine: Engine) -> tuple[float, list[list[int]]]:
    """fp32: perplexity of the text, greedy outputs of the prompts."""
    text = shared_engine.tokenizer.encode(quality.QUALITY_TEXT)
    prompts = quality.encode_prompts(shared_engine)
    return (quality.perplexity(shared_engine, text),
            quality.greedy_outputs(shared_engine, prompts, GREEDY_TOKENS))


def test_every_q4_1_tensor_is_read_as_its_own_blocks(q4_weights: LoadedWeights) -> None:
    """The blocks dequantize to exactly what gguf's dequantizer gave (q/k rows un-permuted alike)."""
    cfg = q4_weights.config
    assert len(q4_weights.q4) == cfg.num_layers * 7  # q k v o gate up down; the embedding is Q8_0
    for name, groups in q4_weights.q4.items():
        assert torch.equal(groups.dequantize(), q4_weights.weights[name]), name


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quality_against_fp32(q4_weights: LoadedWeights, reference: tuple[float, list[list[int]]],
                              quantization: str) -> None:
    ppl_fp32, outputs_fp32 = reference
    engine = build(q4_weights, quantization)
    kind = {"int8": Int8Linear, "int4": Int4Linear}[quantization]
    assert all(isinstance(getattr(lw, n), kind) for lw in engine.model.layers for n in ("qkv", "o", "gate_up", "down"))
    assert isinstance(engine.model.lm_head, Int8Linear)

    ppl = quality.perplexity(engine, engine.tokenizer.encode(quality.QUALITY_TEXT))
    assert abs(ppl / ppl_fp32 - 1) < PERPLEXITY_BOUND[quantization], (ppl, ppl_fp32)

    outputs = quality.greedy_outputs(engine, quality.encode_prompts(engine), GREEDY_TOKENS)
    agreement = quality.agreement(outputs, outputs_fp32)
    assert [o[0] for o in outputs] == [o[0] for o in outputs_fp32]
    assert agreement.token_fraction >= MIN_TOKEN_AGREEMENT, agreement


def test_int4_streams_a_fifth_of_the_fp32_weight_bytes(q4_weights: LoadedWeights, shared_engine: Engine) -> None:
    fp32 = shared_engine.model.weight_bytes_per_step()
    int4 = build(q4_weights, "int4").model.weight_bytes_per_step()
    # 4.5 bits a weight (bf16 scale + zero per 32) in the layers, 8 in the head, vs 32
    assert 0.15 < int4 / fp32 < 0.2, (int4, fp32)


def test_quantization_is_validated_and_keys_the_kv_hashes() -> None:
    with pytest.raises(ConfigError, match="quantization 'int3' not supported"):
        EngineConfig(quantization="int3")
    assert EngineConfig().kv_tag == "float32"  # unquantized: the hashes of before
    assert EngineConfig(dtype="bf16", quantization="int4").kv_tag == "bfloat16+int4"
    assert EngineConfig(quantization="int8").kv_tag != EngineConfig(quantization="int4").kv_tag
