"""LoRA adapters in the engine: PEFT adapters made by `peft` itself on tiny random checkpoints of
three families, greedy output token-identical to transformers + peft (fp32), in the native decode
and the torch path, co-located and disaggregated (KV pushed layer by layer to a decode engine);
mixed batches of four adapters and the base model equal to each request alone; slots evicted and
paged back in under load; adapters that cannot be served refused with their reason; the KV
prefix cache rooted in the adapter (device cache, host tier, Redis index)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from halfmoon.core.adapters import AdapterRef, InvalidAdapterError
from halfmoon.core.params import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.engine.lora import check_adapter, lora_shapes, normalized_name, read_files, same_model
from halfmoon.kvpool.redis_server import EmbeddedRedis
from halfmoon.kvpool.remote import InProcessReader
from halfmoon.transport import KVReceiver, KVSender, get_backend
from tests.conftest import NUM_THREADS
from tests.lora_support import make_adapter, peft_greedy
from tests.model_families import BY_NAME, build_checkpoint, hf_greedy, prompts

pytestmark = [pytest.mark.timeout(600)]
NEW = 24
FAMILIES = ("llama", "qwen2", "gemma3")


class Adapted:
    """A family's base checkpoint, four adapters of it, and transformers + peft's greedy outputs."""

    def __init__(self, family: str, root: Path) -> None:
        self.case = BY_NAME[family]
        self.base_dir = root / "base"
        base = build_checkpoint(self.case, self.base_dir)
        self.prompts = prompts(2)
        self.base_expected = [hf_greedy(base, p, NEW) for p in self.prompts]
        # four adapters: every module rank 8; q/v only rank 4; rsLoRA rank 16; MLP only rank 2
        shapes = [dict(rank=8), dict(rank=4, targets=("q_proj", "v_proj")), dict(rank=16, rslora=True),
                  dict(rank=2, targets=("gate_proj", "up_proj", "down_proj"))]
        self.refs: list[AdapterRef] = []
        self.expected: list[list[list[int]]] = []
        for i, kw in enumerate(shapes):
            folder = root / f"a{i}"
            model = make_adapter(self.case, folder, seed=100 + i, base_name=str(self.base_dir), **kw)
            self.refs.append(AdapterRef(f"a{i}", str(folder), read_files(folder, f"a{i}").digest))
            self.expected.append([peft_greedy(model, p, NEW) for p in self.prompts])

    def engine(self, remote: InProcessReader | None = None, **overrides: Any) -> Engine:
        return Engine(EngineConfig(**{"model": str(self.base_dir), "num_blocks": 96, "num_threads": NUM_THREADS,
                                      "max_num_batched_tokens": 32, **overrides}), remote=remote)


@pytest.fixture(scope="module", params=FAMILIES)
def adapted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Adapted:
    return Adapted(request.param, tmp_path_factory.mktemp(f"lora-{request.param}"))


def greedy(engine: Engine, prompt_ids: list[list[int]], adapter: AdapterRef | None) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, adapter=adapter)
    return [r.output_ids for r in engine.generate(prompt_ids, params)]


@pytest.mark.parametrize("fused", [True, False], ids=["native-decode", "torch-path"])
def test_each_adapter_is_token_identical_to_transformers_and_peft(adapted: Adapted, fused: bool) -> None:
    engine = adapted.engine()
    engine.model.fused_decode = fused
    for ref, expected in zip(adapted.refs, adapted.expected):
        assert expected != adapted.base_expected  # the adapter changes the output
        assert greedy(engine, adapted.prompts, ref) == expected, ref.name
    assert greedy(engine, adapted.prompts, None) == adapted.base_expected
    engine.lora.check()


def test_a_batch_mixing_four_adapters_and_the_base_gives_each_its_own_tokens(adapted: Adapted) -> None:
    """All ten requests (2 prompts x (4 adapters + base)) in one batch, decoding together."""
    engine = adapted.engine()
    jobs = [(p, ref, exp[i]) for ref, exp in zip([*adapted.refs, None], [*adapted.expected, adapted.base_expected])
            for i, p in enumerate(adapted.prompts)]
    ids = [engine.add_request(p, SamplingParams(max_tokens=NEW, ignore_eos=True, adapter=ref)) for p, ref, _ in jobs]
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    widest = 0
    while engine.has_unfinished():
        chunks = engine.step()
        widest = max(widest, len(engine.scheduler.running))
        for c in chunks:
            outputs[c.request_id] += c.token_ids
    assert widest == len(jobs)  # they did decode together
    assert [outputs[rid] for rid in ids] == [exp for _, _, exp in jobs]
    stats = engine.lora.stats
    assert stats.disk_loads == 4 and stats.page_ins == 4 and stats.evictions == 0
    engine.lora.check()


def test_more_adapters_than_slots_are_paged_in_and_out_without_changing_a_token(adapted: Adapted) -> None:
    """Two slots, four adapters in flight: a step serves at most two adapters, the others wait
    their turn; evicted adapters page back in from the host cache."""
    engine = adapted.engine(max_loras=2, max_cpu_loras=2)
    jobs = [(p, ref, exp[i]) for ref, exp in zip(adapted.refs, adapted.expected) for i, p in enumerate(adapted.prompts)]
    ids = [engine.add_request(p, SamplingParams(max_tokens=NEW, ignore_eos=True, adapter=ref)) for p, ref, _ in jobs]
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for c in engine.step():
            outputs[c.request_id] += c.token_ids
        assert len({r.params.adapter for r in engine.scheduler.running}) <= 4
        engine.lora.check()
    assert [outputs[rid] for rid in ids] == [exp for _, _, exp in jobs]
    assert engine.lora.stats.evictions > 0
    assert engine.lora.stats.disk_loads > 4  # the host cache held two: some were read again


def test_disaggregated_prefill_and_decode_both_run_the_adapter(adapted: Adapted) -> None:
    prefill, decode = adapted.engine(), adapted.engine()
    layout, backend = prefill.kv_layout(), get_backend("local")
    receiver = KVReceiver(decode.kv_cache, layout, backend, timeout=10.0).start()
    sender = KVSender(prefill.kv_cache, layout, backend, receiver.address, timeout=10.0)
    bs = prefill.config.block_size
    try:
        for ref, expected in [(adapted.refs[0], adapted.expected[0]), (adapted.refs[2], adapted.expected[2])]:
            params = SamplingParams(max_tokens=NEW, ignore_eos=True, adapter=ref)
            for i, prompt in enumerate(adapted.prompts):
                rid, prompt_blocks = f"{ref.name}-{i}", -(-len(prompt) // bs)
                blocks = decode.reserve_blocks(len(prompt) + NEW)
                receiver.expect(rid, blocks[:prompt_blocks])
                prefill.add_request(prompt, params, request_id=rid,
                                    kv_push=sender.open(rid, blocks[:prompt_blocks]))
                while prefill.has_unfinished():
                    prefill.step()
                meta = receiver.wait(rid, 30).meta
                decode.add_prefilled(prompt, meta["first_token"], params, blocks, request_id=rid)
                out: list[int] = []
                while decode.has_unfinished():
                    for chunk in decode.step():
                        out += chunk.token_ids
                assert out == expected[i], rid
        prefill.step()
    finally:
        sender.close()
        receiver.close()
    assert prefill.lora.stats.requests == decode.lora.stats.requests == {"a0": 2, "a2": 2}


def test_the_prefix_cache_is_rooted_in_the_adapter(adapted: Adapted) -> None:
    """The same prompt under adapter A, then B, then the base: neither B nor the base hits A's
    blocks; A again hits its own."""
    engine = adapted.engine()
    prompt = adapted.prompts[0]
    a, b = adapted.refs[0], adapted.refs[1]

    def cached(ref: AdapterRef | None) -> int:
        return engine.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True, adapter=ref))[0].num_cached_tokens

    assert cached(a) == 0
    assert engine.cached_prefix_tokens(prompt, adapter=a) == 32
    assert cached(b) == 0 and cached(None) == 0
    assert cached(a) == 32  # two full blocks of the 40-token prompt
    assert engine._root_hash(len(prompt), None, a) != engine._root_hash(len(prompt), None, b)
    assert engine._root_hash(len(prompt), None, None) != engine._root_hash(len(prompt), None, a)


# ---------------------------------------------------------------- across the tiers and the index


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Adapted:
    return Adapted("llama", tmp_path_factory.mktemp("lora-tiers"))


def test_a_prefix_under_one_adapter_is_no_hit_for_another_through_the_redis_index(llama: Adapted) -> None:
    """Engine X computes a prompt under adapter A; through the Redis index, engine Y finds it
    for A (fetched from X), and not for B or the base model (recomputed)."""
    reader = InProcessReader()
    with EmbeddedRedis() as redis:
        x, y = (llama.engine(remote=reader, redis_url=redis.url, worker_id=f"w{i}",
                             node_id=f"node{i}", num_blocks=32) for i in range(2))
        try:
            prompt = llama.prompts[0]

            def computed(engine: Engine, ref: AdapterRef | None) -> tuple[list[int], int]:
                before = engine.scheduler.stats.prompt_tokens_computed
                out = engine.generate([prompt], SamplingParams(max_tokens=NEW, ignore_eos=True, adapter=ref))[0]
                assert engine.tiers.flush(30)
                return out.output_ids, engine.scheduler.stats.prompt_tokens_computed - before

            out, n = computed(x, llama.refs[0])
            assert n == len(prompt) and out == llama.expected[0][0]
            for ref, expected in [(llama.refs[1], llama.expected[1][0]), (None, llama.base_expected[0])]:
                out, n = computed(y, ref)
                assert n == len(prompt), f"{ref}: a hit on another adapter's blocks"
                assert out == expected
            assert y.tiers.traffic.fetched_remote == 0
            out, n = computed(y, llama.refs[0])
            assert n == len(prompt) - 32 and y.tiers.traffic.fetched_remote == 2  # A's two blocks, fetched
            assert out == llama.expected[0][0]
        finally:
            x.close()
            y.close()


def test_a_prefix_under_one_adapter_is_no_hit_for_another_in_the_host_tier(llama: Adapted) -> None:
    """A's blocks spilled to the host tier (other prompts filled the device cache): B and the base
    model recompute the prompt, A promotes its blocks back from the host."""
    engine = llama.engine(num_blocks=8, host_cache_gb=0.01)
    prompt, params = llama.prompts[0], SamplingParams(max_tokens=NEW, ignore_eos=True, adapter=llama.refs[0])

    def run(ref: AdapterRef | None, ids: list[int]) -> list[int]:
        return engine.generate([ids], SamplingParams(max_tokens=NEW, ignore_eos=True, adapter=ref))[0].output_ids

    assert run(llama.refs[0], prompt) == llama.expected[0][0]
    for other in prompts(3, 40)[1:] + [[7] * 40, [9] * 40]:  # fill the device cache: A's blocks spill
        run(None, other)
    assert engine.tiers.flush(30)
    assert engine.tiers.host is not None and engine.tiers.host.num_used() >= 2
    assert engine.cached_prefix_tokens(prompt, adapter=params.adapter) == 0  # not on the device any more
    for ref, expected in [(llama.refs[1], llama.expected[1][0]), (None, llama.base_expected[0])]:
        before = engine.tiers.traffic.promoted_from_host
        assert run(ref, prompt) == expected
        assert engine.tiers.traffic.promoted_from_host == before, f"{ref}: a hit on A's blocks in the host tier"
    before = engine.tiers.traffic.promoted_from_host
    assert run(llama.refs[0], prompt) == llama.expected[0][0]
    assert engine.tiers.traffic.promoted_from_host == before + 2
    engine.close()


# ---------------------------------------------------------------- refusals


def _bad(tmp_path: Path, llama: Adapted, edit: Any) -> Path:
    """A copy of adapter a0 changed by `edit(config, tensors)`."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bad"
    folder.mkdir()
    src = Path(llama.refs[0].path)
    config = json.loads((src / "adapter_config.json").read_text())
    tensors = load_file(src / "adapter_model.safetensors")
    edit(config, tensors)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "adapter_model.safetensors")
    return folder


def _rename(tensors: dict[str, torch.Tensor], old: str, new: str) -> None:
    for key in [k for k in tensors if old in k]:
        tensors[key.replace(old, new)] = tensors.pop(key)


REFUSALS = {
    "dora": (lambda c, t: c.update(use_dora=True), "DoRA"),
    "bias": (lambda c, t: c.update(bias="all"), "bias 'all'"),
    "modules_to_save": (lambda c, t: c.update(modules_to_save=["lm_head"]), "modules_to_save"),
    "prompt tuning": (lambda c, t: c.update(peft_type="PROMPT_TUNING"), "peft_type"),
    "lm_head target": (lambda c, t: _rename(t, "layers.0.self_attn.q_proj", "layers.0.self_attn.lm_head"),
                       "target module 'lm_head'"),
    "layer past the model": (lambda c, t: _rename(t, "layers.2.", "layers.7."), "layer 7"),
    "wrong shape": (lambda c, t: t.update({k: v[:, :10].contiguous() for k, v in t.items() if "q_proj.lora_A" in k}),
                    "do not fit"),
    "A without B": (lambda c, t: [t.pop(k) for k in [k for k in t if "o_proj.lora_B" in k]], "without lora_B"),
    "other base model": (lambda c, t: c.update(base_model_name_or_path="Qwen/Qwen2.5-7B-Instruct"), "trained on"),
    "nan": (lambda c, t: t.update({k: v * float("nan") for k, v in t.items() if "v_proj.lora_B" in k}), "NaN"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_an_adapter_that_cannot_be_served_is_refused_with_its_reason(case: str, llama: Adapted, tmp_path: Path) -> None:
    edit, needle = REFUSALS[case]
    folder = _bad(tmp_path, llama, edit)
    shapes = lora_shapes(llama.engine().model_config, (str(llama.base_dir),))
    with pytest.raises(InvalidAdapterError, match=needle):
        check_adapter(read_files(folder, "bad"), "bad", shapes, max_rank=16)


def test_missing_files_and_a_rank_over_the_limit_are_refused(llama: Adapted, tmp_path: Path) -> None:
    shapes = lora_shapes(llama.engine().model_config)
    with pytest.raises(InvalidAdapterError, match="is not a folder"):
        read_files(tmp_path / "nowhere", "x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidAdapterError, match="adapter_config.json"):
        read_files(tmp_path / "empty", "x")
    (tmp_path / "empty" / "adapter_config.json").write_text("{}")
    with pytest.raises(InvalidAdapterError, match="no adapter_model.safetensors"):
        read_files(tmp_path / "empty", "x")
    (tmp_path / "empty" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(InvalidAdapterError, match="not a readable safetensors"):
        read_files(tmp_path / "empty", "x")
    with pytest.raises(InvalidAdapterError, match="rank 16 .* --max-lora-rank 8"):
        check_adapter(read_files(llama.refs[2].path, "r16"), "r16", shapes, max_rank=8)


def test_files_changed_after_loading_are_refused_by_the_worker(llama: Adapted, tmp_path: Path) -> None:
    engine = llama.engine()
    stale = AdapterRef("a0", llama.refs[0].path, "0" * 32)
    with pytest.raises(InvalidAdapterError, match="changed since it was loaded"):
        engine.generate([llama.prompts[0]], SamplingParams(max_tokens=2, adapter=stale))
    assert not engine.has_unfinished()


def test_base_model_names_match_across_hub_ids_and_gguf_files() -> None:
    assert normalized_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "smollm2-135m-instruct"
    assert normalized_name("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct"
    assert normalized_name("gemma-3-270m-q4_k_m.gguf") == "gemma-3-270m"
    assert same_model("google/gemma-3-270m-it", "gemma-3-270m")
    assert same_model("HuggingFaceTB/SmolLM2-135M", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert not same_model("Qwen/Qwen2.5-0.5B", "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_speculative_decoding_under_adapters_keeps_their_tokens(llama: Adapted) -> None:
    """ngram speculation: verification steps run the adapters on every drafted row (the drafts
    come from the text, not the adapter): the outputs stay transformers + peft's."""
    engine = llama.engine(speculative="ngram")
    params = [SamplingParams(max_tokens=NEW, ignore_eos=True, adapter=ref) for ref in llama.refs for _ in llama.prompts]
    got = [r.output_ids for r in engine.generate(llama.prompts * 4, params)]
    assert got == [exp[i] for exp in llama.expected for i in range(len(llama.prompts))]
    assert engine.speculator is not None and engine.speculator.stats.proposed > 0  # drafts were verified
