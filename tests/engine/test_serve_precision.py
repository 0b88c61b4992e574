"""`halfmoon serve` with no flags keeps the model's quality. Its precision is `--dtype auto`
(conductor/serve_defaults.py): bf16 on CUDA and on a CPU with oneDNN's bf16 path, fp32 elsewhere,
weights unquantized. The bf16 engine is loaded from the real SmolLM2 GGUF, as a worker loads it,
and held to the bounds the quantization tests use (engine/quality.py): perplexity of the quality
text within 1% of fp32's, the next-token argmax at >= 90% of the text's positions
(teacher-forced) equal to fp32's, and the first greedy token of every quality prompt equal. It
is tested on every machine, whatever `auto` picks here; fp32, the other pick, is the reference.

The token-exact mode is a flag: `--dtype float32 --quantization none` builds the fp32 engine the
token-identity tests compare against transformers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from halfmoon.cli.components import SERVE_ENGINE
from halfmoon.cli.flags import build
from halfmoon.cli.main import parse_args
from halfmoon.conductor.serve_defaults import EXACT_FLAGS, SERVE_QUANTIZATION, precision_line, serve_engine
from halfmoon.engine import quality
from halfmoon.engine.config import EngineConfig, auto_dtype, choose_dtype
from halfmoon.engine.engine import Engine

GREEDY_TOKENS = 4  # only the first token is held (free continuations part where logits near-tie)


def test_auto_picks_bf16_where_it_has_a_native_gemm_and_fp32_elsewhere() -> None:
    assert choose_dtype("cpu", onednn_bf16=True)[0] == "bfloat16"
    assert choose_dtype("cpu", onednn_bf16=False)[0] == "float32"
    assert choose_dtype("cuda", onednn_bf16=False)[0] == "bfloat16"
    assert "no oneDNN bf16 path" in choose_dtype("cpu", False)[1]
    assert (EngineConfig(dtype="auto").dtype, EngineConfig(dtype="auto", device="cuda").dtype) == (
        auto_dtype("cpu")[0], "bfloat16")
    assert EngineConfig().dtype == "float32"  # the class's own default stays token-exact


def test_serve_without_flags_runs_auto_unquantized_and_the_exact_mode_is_a_flag() -> None:
    args = parse_args(["serve"])
    default = build(SERVE_ENGINE, args)
    assert (args.dtype, default.dtype, default.quantization) == ("auto", auto_dtype("cpu")[0], SERVE_QUANTIZATION)
    assert (default.dtype, default.quantization) == (serve_engine().dtype, serve_engine().quantization)
    assert default.quantization == "none"  # int8 / int4 served less goodput (docs/BENCHMARKS.md)
    exact = build(SERVE_ENGINE, parse_args(["serve", *EXACT_FLAGS]))
    assert (exact.dtype, exact.quantization, exact.kv_tag) == ("float32", "none", "float32")
    said = precision_line(args.dtype, args.quantization)  # what serve prints at start
    assert said.startswith(f"precision {default.dtype}, quantization none (--dtype auto: {auto_dtype('cpu')[1]}")
    assert "token-exact" in precision_line(*EXACT_FLAGS[1::2])


@pytest.fixture(scope="module")
def bf16_engine() -> Iterator[Engine]:
    """The bf16 engine `auto` serves on a bf16 CPU, from serve's config (no host tier, 32 blocks,
    one thread): the GGUF loaded as a worker loads it, no weights shared with the fp32 engine's."""
    engine = Engine(dataclasses.replace(serve_engine(), dtype="bfloat16", num_blocks=32, num_threads=1,
                                        host_cache_gb=0.0))
    yield engine
    engine.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bf16_holds_the_quality_bounds_against_fp32(bf16_engine: Engine, shared_engine: Engine) -> None:
    assert bf16_engine.kv_cache.dtype == torch.bfloat16 and bf16_engine.config.quantization == "none"
    text = shared_engine.tokenizer.encode(quality.QUALITY_TEXT)
    assert bf16_engine.tokenizer.encode(quality.QUALITY_TEXT) == text
    ppl_fp32, ppl = quality.perplexity(shared_engine, text), quality.perplexity(bf16_engine, text)
    top1_fp32 = quality.prefill_logits(shared_engine, text).argmax(-1)
    top1 = (quality.prefill_logits(bf16_engine, text).argmax(-1) == top1_fp32).float().mean().item()
    prompts = quality.encode_prompts(shared_engine)
    first = [o[0] for o in quality.greedy_outputs(bf16_engine, prompts, GREEDY_TOKENS)]
    first_fp32 = [o[0] for o in quality.greedy_outputs(shared_engine, prompts, GREEDY_TOKENS)]
    print(f"bf16: perplexity {ppl:.3f} vs fp32 {ppl_fp32:.3f} ({ppl / ppl_fp32 - 1:+.2%}), teacher-forced "
          f"top-1 {top1:.3f}, first tokens {sum(a == b for a, b in zip(first, first_fp32))}/{len(first)}")
    assert abs(ppl / ppl_fp32 - 1) < quality.PERPLEXITY_BOUND["none"], (ppl, ppl_fp32)
    assert top1 >= quality.MIN_TOP1_AGREEMENT, top1
    assert first == first_fp32
