"""Every supported family, token-identical to transformers: tiny random-weight checkpoints of
Llama (with each rope scaling type), Mistral, Qwen2, Qwen3 and Gemma 3 (tests/model_families.py),
64 greedy tokens after 40-token prompts, prefilled in 32-token chunks so chunked prefill runs
past the sliding windows. In the engine (native fused decode and the torch path), and
disaggregated: prefill in one engine, KV pushed layer by layer over the transport to a decode
engine, where sliding layers' dead blocks are not sent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from halfmoon.core.blocks import first_visible_block
from halfmoon.core.params import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.engine.errors import UnsupportedModelError
from halfmoon.engine.families import config_from_hf
from tests.conftest import NUM_THREADS
from tests.model_families import BY_NAME, CASES, NEW, FamilyCase, build_checkpoint, hf_greedy, prompts
from halfmoon.transport import KVReceiver, KVSender, get_backend

pytestmark = [pytest.mark.timeout(300)]
BUDGET = 32  # tokens per step: the 40-token prompts are prefilled in two chunks


class Checkpoint:
    """A case's HF folder and transformers' greedy continuations of `prompts()`."""

    def __init__(self, case: FamilyCase, folder: Path) -> None:
        self.case, self.folder = case, folder
        model = build_checkpoint(case, folder)
        self.prompts = prompts(2)
        self.expected = [hf_greedy(model, p) for p in self.prompts]

    def engine(self, **overrides: Any) -> Engine:
        return Engine(EngineConfig(**{"model": str(self.folder), "num_blocks": 64, "num_threads": NUM_THREADS,
                                      "max_num_batched_tokens": BUDGET, **overrides}))


@pytest.fixture(scope="module", params=CASES, ids=str)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    case: FamilyCase = request.param
    return Checkpoint(case, tmp_path_factory.mktemp("families") / case.name)


def greedy(engine: Engine, prompt_ids: list[list[int]]) -> list[list[int]]:
    return [r.output_ids for r in engine.generate(prompt_ids, SamplingParams(max_tokens=NEW, ignore_eos=True))]


@pytest.mark.parametrize("fused", [True, False], ids=["native-decode", "torch-path"])
def test_engine_is_token_identical_to_transformers(checkpoint: Checkpoint, fused: bool) -> None:
    engine = checkpoint.engine()
    assert engine.model_config.architecture == checkpoint.case.name.split("-")[0]
    if fused:
        assert engine.model.fused_decode, "the native decode path should serve this family"
    engine.model.fused_decode = fused
    assert greedy(engine, checkpoint.prompts) == checkpoint.expected


def test_disaggregated_over_the_transport_is_token_identical(checkpoint: Checkpoint) -> None:
    prefill, decode = checkpoint.engine(), checkpoint.engine()
    backend = get_backend("local")
    layout = prefill.kv_layout()
    assert layout == decode.kv_layout()
    assert [layout.window(i) for i in range(layout.num_layers)] == [prefill.model_config.window(i)
                                                                   for i in range(layout.num_layers)]
    receiver = KVReceiver(decode.kv_cache, layout, backend, timeout=10.0).start()
    sender = KVSender(prefill.kv_cache, layout, backend, receiver.address, timeout=10.0)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    bs = prefill.config.block_size
    try:
        outputs = []
        for i, prompt in enumerate(checkpoint.prompts):
            rid, prompt_blocks = f"r{i}", -(-len(prompt) // bs)
            blocks = decode.reserve_blocks(len(prompt) + NEW)
            receiver.expect(rid, blocks[:prompt_blocks])
            stream = sender.open(rid, blocks[:prompt_blocks], record=True)
            prefill.add_request(prompt, params, request_id=rid, kv_push=stream)
            while prefill.has_unfinished():
                prefill.step()
            meta = receiver.wait(rid, 30).meta
            # each layer got exactly the blocks its window still sees
            sent = {layer: 0 for layer in range(layout.num_layers)}
            for unit in stream.log or []:
                sent[unit.layer] += unit.blocks
            assert sent == {layer: prompt_blocks - first_visible_block(len(prompt), layout.window(layer), bs)
                            for layer in sent}
            decode.add_prefilled(prompt, meta["first_token"], params, blocks, request_id=rid)
            out: list[int] = []
            while decode.has_unfinished():
                for chunk in decode.step():
                    out += chunk.token_ids
            outputs.append(out)
        prefill.step()  # releases the blocks whose units have left
        assert outputs == checkpoint.expected
        # a request whose sliding layers were cut short leaves nothing in the decode side's cache
        truncated = decode.window_truncated(len(checkpoint.prompts[0]))
        assert truncated == any(layout.windows)
        assert (decode.pool.num_cached() == 0) == truncated
    finally:
        sender.close()
        receiver.close()


# Teacher-forced top-1 agreement with the fp32 engine over prompt + continuation, per family.
# Measured on these random-weight checkpoints (2026-11-28): bf16 0.95-1.0, int8 0.94-1.0, int4
# 0.63-0.97 (Gaussian weights have no structure for 4 bits to keep; SmolLM2 int4: 0.97 and the
# real Gemma 3 270M in tests/engine/test_gemma3.py). Chance is 1/384: a family whose quantized
# path dropped a bias, a norm or a window would sit near it.
MIN_AGREEMENT = {("bfloat16", "none"): 0.9, ("float32", "int8"): 0.9, ("bfloat16", "int4"): 0.55}


@pytest.mark.parametrize("dtype,quantization", list(MIN_AGREEMENT), ids=lambda v: str(v))
def test_bf16_and_quantized_paths_serve_every_family(checkpoint: Checkpoint, dtype: str, quantization: str) -> None:
    from halfmoon.engine.quality import prefill_logits  # noqa: PLC0415

    ids = checkpoint.prompts[0] + checkpoint.expected[0]
    start = len(checkpoint.prompts[0]) - 1
    want = prefill_logits(checkpoint.engine(), ids)[start:-1].argmax(-1)
    engine = checkpoint.engine(dtype=dtype, quantization=quantization)
    got = prefill_logits(engine, ids)[start:-1].argmax(-1)
    agreement = (got == want).float().mean().item()
    assert agreement >= MIN_AGREEMENT[(dtype, quantization)], agreement
    assert len(greedy(engine, checkpoint.prompts[:1])[0]) == NEW  # decode (native path) runs too


# ---------------------------------------------------------------- refusals and config formats


def _config(**kw: Any) -> dict[str, Any]:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256, **kw}


@pytest.mark.parametrize("raw,needle", [
    (_config(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=8), "mixture-of-experts"),
    (_config(model_type="qwen2_moe", num_experts=4), "mixture-of-experts"),
    (_config(rope_scaling={"rope_type": "longrope", "factor": 2.0}), "rope type 'longrope' not supported"),
    (_config(rope_scaling={"type": "su", "factor": 2.0}), "rope type 'su' not supported"),
    (_config(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"], vision_config={}),
     "vision tower"),
    (_config(model_type="phi3", architectures=["Phi3ForCausalLM"]), "model_type 'phi3'"),
    (_config(model_type="gemma3_text", attn_logit_softcapping=50.0), "softcapping"),
])
def test_what_cannot_be_served_is_refused_with_one_clear_error(raw: dict[str, Any], needle: str) -> None:
    with pytest.raises(UnsupportedModelError, match=needle):
        config_from_hf(raw, Path("/models/x"))


def test_a_refused_folder_fails_at_load_naming_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_config(model_type="mixtral", num_local_experts=8)))
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        Engine(EngineConfig(model=str(tmp_path), num_blocks=4))


def test_v4_and_v5_config_formats_parse_alike() -> None:
    """Checkpoints on the Hub carry rope_theta + rope_scaling (transformers 4); save_pretrained of
    transformers 5 writes rope_parameters. Llama 3.1's real values."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    v4 = config_from_hf(_config(rope_theta=500000.0, rope_scaling=llama3, max_position_embeddings=131072,
                                eos_token_id=[128001, 128008, 128009]), Path("/m/llama31"))
    v5 = config_from_hf(_config(rope_parameters={**llama3, "rope_theta": 500000.0}, max_position_embeddings=131072,
                                eos_token_id=[128001, 128008, 128009]), Path("/m/llama31"))
    assert v4 == v5
    assert v4.rope_scaling is not None and v4.rope_scaling.kind == "llama3" and v4.rope_theta == 500000.0
    assert v4.rope_scaling.original_max_position == 8192 and v4.stop_ids == (128001, 128008, 128009)
    gemma_v4 = config_from_hf(_config(model_type="gemma3_text", rope_theta=1e6, rope_local_base_freq=1e4,
                                      sliding_window=512, num_hidden_layers=6, query_pre_attn_scalar=256,
                                      rope_scaling={"rope_type": "linear", "factor": 8.0}), Path("/m/g"))
    gemma_v5 = config_from_hf(_config(model_type="gemma3_text", sliding_window=512, num_hidden_layers=6,
                                      query_pre_attn_scalar=256, rope_parameters={
                                          "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
                              Path("/m/g"))
    assert gemma_v4 == gemma_v5
    assert gemma_v4.layer_windows == (512, 512, 512, 512, 512, 0) and gemma_v4.local_rope_theta == 1e4


def test_the_block_hash_root_names_the_family(tmp_path: Path) -> None:
    """Two families with the same shapes never share KV blocks: the fingerprint covers the family."""
    a = config_from_hf(_config(), Path("/m/a"))
    b = config_from_hf(_config(model_type="mistral", architectures=["MistralForCausalLM"]), Path("/m/a"))
    assert a.fingerprint != b.fingerprint


def test_dynamic_ntk_prompts_past_the_trained_context_get_their_own_prefix_root(tmp_path: Path) -> None:
    """A prompt longer than max_position_embeddings is rotated with frequencies of its own length
    (as HF does): its blocks must not serve a prompt of another length."""
    ckpt_case = BY_NAME["llama-dynamic-rope"]
    build_checkpoint(ckpt_case, tmp_path / "m")
    engine = Engine(EngineConfig(model=str(tmp_path / "m"), num_blocks=32, num_threads=NUM_THREADS))
    trained = engine.model.dynamic_from
    assert trained == 64 and engine.max_model_len > trained
    assert engine._root_hash(trained, None) == engine._root_hash(trained - 1, None)
    assert engine._root_hash(trained + 1, None) != engine._root_hash(trained + 2, None)
