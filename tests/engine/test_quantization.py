"""`--quantization int8|int4` on the real SmolLM2 weights: the source's own 4-bit blocks, and the
quality bounds of issue 23 against the fp32 engine.

Measured here (1 thread, engine/quality.py's text of 191 tokens and 8 prompts, 16 greedy tokens
each; after the native int4 kernel and the in-place decode attention): perplexity fp32 28.58;
int8 +0.56%, int4 +0.19% (its lm head is int8: the tied embedding is Q8_0 in the file, no 4-bit
source). The next-token argmax at each position of the text (teacher-forced) equals fp32's at
96.3% (int8) and 97.4% (int4) of the positions, and the first greedy token on 8/8 prompts. Free
greedy continuations are no measure: near-tied logits flip and a greedy path never rejoins, so
over 16 tokens the matching prefixes cover 48-59% of the tokens and move with any change of
rounding (bf16 without quantization covers about the same). So the bounds asserted are the
issue's perplexity bounds, every first token and >= 90% teacher-forced top-1 agreement.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest import mock

import pytest
import torch

import halfmoon.engine.engine as engine_module
from halfmoon.core.errors import ConfigError
from halfmoon.engine import quality
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.engine.loader import LoadedWeights, read_q4_blocks
from halfmoon.kernels.quant_linear import Int4Linear, Int8Linear

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PERPLEXITY_BOUND, MIN_TOP1_AGREEMENT = quality.PERPLEXITY_BOUND, quality.MIN_TOP1_AGREEMENT
GREEDY_TOKENS = 16


@pytest.fixture(scope="module")
def q4_weights(smollm2_weights: LoadedWeights, gguf_path: Path) -> LoadedWeights:
    q4 = read_q4_blocks(gguf_path, smollm2_weights.gguf_reader, smollm2_weights.config)
    return dataclasses.replace(smollm2_weights, q4=q4)


def build(weights: LoadedWeights, quantization: str) -> Engine:
    config = EngineConfig(model="smollm2", quantization=quantization, num_blocks=32, num_threads=1)
    with mock.patch.object(engine_module, "load_weights", return_value=weights):
        return Engine(config)


@pytest.fixture(scope="module")
def reference(shared_engine: Engine) -> tuple[float, list[list[int]], torch.Tensor]:
    """fp32: perplexity of the text, greedy outputs of the prompts, next-token argmax at every
    position of the text."""
    text = shared_engine.tokenizer.encode(quality.QUALITY_TEXT)
    prompts = quality.encode_prompts(shared_engine)
    return (quality.perplexity(shared_engine, text),
            quality.greedy_outputs(shared_engine, prompts, GREEDY_TOKENS),
            quality.prefill_logits(shared_engine, text).argmax(-1))


def test_every_q4_1_tensor_is_read_as_its_own_blocks(q4_weights: LoadedWeights) -> None:
    """The blocks dequantize to exactly what gguf's dequantizer gave (q/k rows un-permuted alike)."""
    cfg = q4_weights.config
    assert len(q4_weights.q4) == cfg.num_layers * 7  # q k v o gate up down; the embedding is Q8_0
    for name, groups in q4_weights.q4.items():
        assert torch.equal(groups.dequantize(), q4_weights.weights[name]), name


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quality_against_fp32(q4_weights: LoadedWeights, reference: tuple[float, list[list[int]], torch.Tensor],
                              quantization: str) -> None:
    ppl_fp32, outputs_fp32, top1_fp32 = reference
    engine = build(q4_weights, quantization)
    kind = {"int8": Int8Linear, "int4": Int4Linear}[quantization]
    assert all(isinstance(getattr(lw, n), kind) for lw in engine.model.layers for n in ("qkv", "o", "gate_up", "down"))
    assert isinstance(engine.model.lm_head, Int8Linear)

    text = engine.tokenizer.encode(quality.QUALITY_TEXT)
    ppl = quality.perplexity(engine, text)
    assert abs(ppl / ppl_fp32 - 1) < PERPLEXITY_BOUND[quantization], (ppl, ppl_fp32)
    top1 = (quality.prefill_logits(engine, text).argmax(-1) == top1_fp32).float().mean().item()

    outputs = quality.greedy_outputs(engine, quality.encode_prompts(engine), GREEDY_TOKENS)
    agreement = quality.agreement(outputs, outputs_fp32)
    print(f"{quantization}: perplexity {ppl / ppl_fp32 - 1:+.2%}, top-1 {top1:.3f}, {agreement}")
    assert [o[0] for o in outputs] == [o[0] for o in outputs_fp32]
    assert top1 >= MIN_TOP1_AGREEMENT, top1


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
