"""The engine on a GPU: paged KV with the torch and flashinfer attention backends against a dense
reference (transformers' `LlamaForCausalLM`, fp32, on the same GPU) with the same random weights.

CUDA only: skipped with a reason where there is none (the CPU engine is checked against the same
oracle on the real SmolLM2 weights in test_engine_correctness.py).

The model is a tiny random Llama (2 layers, hidden 256, 4 heads over 2 KV heads of 64, vocab 512)
in the loader's HF-named layout. The engine has no device setting: weights come from the loader,
and everything else (KV cache, RoPE tables, the runner's inputs and attention metadata) from
factory calls on torch's default device. So the weights are put on CUDA and the engine is built
and stepped under `torch.device("cuda")`. Three prompts (5, 19 and 37 tokens, block size 16) run
as one batch with a 32-token budget: the 37-token prompt is prefilled in two chunks, the second
after a cached prefix, in the same steps as the others' decodes.

* fp32, torch backend: the reference's greedy tokens exactly (every step of the reference's path
  has a top-1 vs top-2 gap above `MIN_MARGIN` > 2 * `FP32_ATOL`), and the logits it sampled from
  within `FP32_ATOL` of the reference's.
* bf16, torch and flashinfer backends: the logits each sampled from against the reference's
  logits on that run's own tokens (one teacher-forced forward), within `BF16_ATOL` and a relative
  RMS error of `BF16_RTOL`. Greedy paths may part where bf16 noise can flip a token: each run
  follows the reference's tokens, and the flashinfer run the torch run's, up to a step where the
  reference's top-2 gap is under 2 * `BF16_ATOL`, if any; the steps (which requests, how many
  tokens) are the same for both backends.

Tolerances, measured with this model on CPU (torch backend): fp32 logits differ from the
reference's by at most 2e-5; bf16 by at most 0.19 (relative RMS 1.1%), logits having a
standard deviation of about 4. The tolerances allow 3x the bf16 figures, 50x the fp32 one; a
wrong page, mask or position moves logits by whole units.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

import halfmoon.engine.engine as engine_module
import halfmoon.engine.runner as runner_module
from halfmoon.core.params import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.engine.loader import LoadedWeights
from halfmoon.engine.model_config import ModelConfig
from halfmoon.engine.request import Request
from halfmoon.engine.scheduler import ScheduledRequest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="runs the engine on CUDA; this machine has no CUDA device"),
]

DEVICE = "cuda"  # the fixtures' device (the helpers take any)
SEED = 2  # weights and prompts; its reference paths' smallest top-2 gap is 0.22 (CPU, fp32)
PROMPT_LENS = (5, 19, 37)
NUM_NEW = 8
BLOCK_SIZE = 16
BUDGET = 32  # tokens per step: the 37-token prompt is chunked
FP32_ATOL = 1e-3
MIN_MARGIN = 1e-2
BF16_ATOL = 0.6
BF16_RTOL = 0.03
LOGIT_STD = 4.0

CFG = ModelConfig(
    architecture="llama", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
    head_dim=64, intermediate_size=512, vocab_size=512, rope_theta=10000.0, rms_norm_eps=1e-5,
    max_position=256, tie_word_embeddings=False, bos_id=None, eos_id=0,
    source_id="test:tiny-random-llama",
)


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """HF-named fp32 weights on the CPU: unit-scale residual stream, attention scores and
    logits with a spread of a few units (so attention is not uniform and greedy is decisive)."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    h, inter = cfg.hidden_size, cfg.intermediate_size
    w = {
        "model.embed_tokens.weight": normal(cfg.vocab_size, h, std=1.0),
        "model.norm.weight": 1.0 + normal(h, std=0.1),
        "lm_head.weight": normal(cfg.vocab_size, h, std=LOGIT_STD / h**0.5),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1.0 + normal(h, std=0.1)
        w[p + "post_attention_layernorm.weight"] = 1.0 + normal(h, std=0.1)
        w[p + "self_attn.q_proj.weight"] = normal(cfg.q_size, h, std=0.1)
        w[p + "self_attn.k_proj.weight"] = normal(cfg.kv_size, h, std=0.1)
        w[p + "self_attn.v_proj.weight"] = normal(cfg.kv_size, h, std=h**-0.5)
        w[p + "self_attn.o_proj.weight"] = normal(h, cfg.q_size, std=cfg.q_size**-0.5)
        w[p + "mlp.gate_proj.weight"] = normal(inter, h, std=h**-0.5)
        w[p + "mlp.up_proj.weight"] = normal(inter, h, std=h**-0.5)
        w[p + "mlp.down_proj.weight"] = normal(h, inter, std=inter**-0.5)
    return w


def random_prompts(cfg: ModelConfig, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(1, cfg.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


# ---------------------------------------------------------------- the reference


def hf_model(cfg: ModelConfig, weights: dict[str, torch.Tensor], device: str) -> Any:
    """transformers' Llama with `weights`, fp32, eager attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=False,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config)
    model.load_state_dict(weights, strict=True)
    return model.to(device=device, dtype=torch.float32).eval()


@dataclass(frozen=True)
class Greedy:
    tokens: list[int]  # greedy continuation, NUM_NEW tokens
    margins: list[float]  # top-1 minus top-2 logit at each step
    logits: torch.Tensor  # [NUM_NEW, vocab] fp32 (CPU): the rows each token was chosen from


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], device: str) -> Greedy:
    """Greedy decoding by full forwards (no cache: nothing but the model's own forward)."""
    ids = list(prompt)
    rows, margins = [], []
    for _ in range(NUM_NEW):
        last = model(torch.tensor([ids], device=device)).logits[0, -1].float().cpu()
        top2 = last.topk(2).values
        margins.append(float(top2[0] - top2[1]))
        rows.append(last)
        ids.append(int(last.argmax()))
    return Greedy(ids[len(prompt):], margins, torch.stack(rows))


# ---------------------------------------------------------------- the engine


class StubTokenizer:
    """What the engine's detokenizer asks of a tokenizer; the test works in token ids."""

    def __init__(self, eos_id: int) -> None:
        self.eos_id = eos_id

    def is_special(self, token_id: int) -> bool:
        return False

    def token_bytes(self, token_id: int) -> bytes:
        return f"<{token_id}>".encode()


@dataclass
class EngineRun:
    outputs: list[list[int]]
    logits: list[torch.Tensor]  # per prompt: [NUM_NEW, vocab] fp32 (CPU), the rows sampled from
    steps: list[list[tuple[int, int]]]  # per step: (prompt index, tokens computed)


def run_engine(weights: dict[str, torch.Tensor], prompts: list[list[int]], dtype: str,
               backend: str, device: str) -> EngineRun:
    """Build an engine on `device` with `weights`, greedy-generate NUM_NEW tokens per prompt."""
    config = EngineConfig(model="tiny-random-llama", dtype=dtype, block_size=BLOCK_SIZE,
                          num_blocks=32, max_num_batched_tokens=BUDGET, attention_backend=backend)
    loaded = LoadedWeights(CFG, {k: v.to(device, config.torch_dtype) for k, v in weights.items()},
                           Path("tiny-random-llama"), "hf")
    seen: dict[str, list[torch.Tensor]] = {}
    steps: list[list[tuple[str, int]]] = []
    real_sample = runner_module.sample

    def spy_sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
        for row, req in zip(logits, requests, strict=True):
            seen.setdefault(req.request_id, []).append(row.float().cpu())
        return real_sample(logits, requests)

    tokenizer = StubTokenizer(CFG.eos_id)
    with (torch.device(device),
          mock.patch.object(engine_module, "load_weights", return_value=loaded),
          mock.patch.object(engine_module, "load_tokenizer", return_value=tokenizer),
          mock.patch.object(runner_module, "sample", spy_sample)):
        engine = Engine(config)
        real_run = engine.runner.run

        def spy_run(scheduled: list[ScheduledRequest]) -> list[int]:
            steps.append([(s.request.request_id, s.num_tokens) for s in scheduled])
            return real_run(scheduled)

        engine.runner.run = spy_run  # type: ignore[method-assign]
        assert engine.kv_cache.device.type == device
        results = engine.generate(prompts, SamplingParams(max_tokens=NUM_NEW, ignore_eos=True))
    index = {r.request_id: i for i, r in enumerate(results)}
    return EngineRun(
        outputs=[r.output_ids for r in results],
        logits=[torch.stack(seen[r.request_id]) for r in results],
        steps=[[(index[rid], n) for rid, n in step] for step in steps],
    )


# ---------------------------------------------------------------- fixtures


@dataclass(frozen=True)
class Reference:
    model: Any  # transformers' LlamaForCausalLM, fp32, on DEVICE
    greedy: list[Greedy]  # per prompt

    @torch.inference_mode()
    def logits_along(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """[len(tokens), vocab]: the reference's logits that would pick each of `tokens`."""
        ids = torch.tensor([prompt + tokens], device=DEVICE)
        return self.model(ids).logits[0, len(prompt) - 1 : -1].float().cpu()


@pytest.fixture(scope="module", autouse=True)
def _full_fp32_matmuls() -> Iterator[None]:
    """fp32 means fp32 here, whatever an imported library set (TF32 would cost ~1e-2)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return random_weights(CFG, SEED)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(CFG, SEED)


@pytest.fixture(scope="module")
def reference(weights: dict[str, torch.Tensor], prompts: list[list[int]]) -> Reference:
    pytest.importorskip("transformers")
    model = hf_model(CFG, weights, DEVICE)
    return Reference(model, [hf_greedy(model, p, DEVICE) for p in prompts])


class Runs(dict):  # type: ignore[type-arg]
    """Engine runs by (dtype, backend), each made once, on first use."""

    def __init__(self, weights: dict[str, torch.Tensor], prompts: list[list[int]]) -> None:
        super().__init__()
        self.weights, self.prompts = weights, prompts

    def __missing__(self, key: tuple[str, str]) -> EngineRun:
        dtype, backend = key
        if backend == "flashinfer":
            pytest.importorskip("flashinfer",
                                reason="needs flashinfer: pip install 'halfmoon[gpu]'")
        self[key] = run = run_engine(self.weights, self.prompts, dtype, backend, DEVICE)
        return run


@pytest.fixture(scope="module")
def runs(weights: dict[str, torch.Tensor], prompts: list[list[int]]) -> Runs:
    return Runs(weights, prompts)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def check_parting(ours: list[int], theirs: list[int], ref_rows: torch.Tensor, what: str) -> None:
    """Two greedy paths over the same prompt may part only where the reference is near-tied
    (`ref_rows`: the reference's logits along `ours`, the same as along `theirs` up to there)."""
    step = first_difference(ours, theirs)
    if step is None:
        return
    top2 = ref_rows[step].topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < 2 * BF16_ATOL, (
        f"{what}: tokens part at step {step} ({ours[step]} vs {theirs[step]}) where the "
        f"reference's top-2 gap is {gap:.3f}, not a near-tie")


def check_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    diff = (ours - ref).abs().max().item()
    rel = ((ours - ref).norm() / ref.norm()).item()
    assert diff < BF16_ATOL and rel < BF16_RTOL, (
        f"{what}: max |logit diff| {diff:.3f} (< {BF16_ATOL}), relative RMS {rel:.4f} "
        f"(< {BF16_RTOL})")


# ---------------------------------------------------------------- tests


def test_reference_paths_are_not_near_tied(reference: Reference) -> None:
    # If this fails the weights/prompts are a coin flip even in fp32: change SEED, do not loosen.
    for i, ref in enumerate(reference.greedy):
        worst = min(range(NUM_NEW), key=lambda s: ref.margins[s])
        assert ref.margins[worst] > MIN_MARGIN, (
            f"prompt {i}: top-2 gap {ref.margins[worst]:.2e} at step {worst}")


def test_batch_mixes_chunked_prefill_and_decode(runs: Runs) -> None:
    steps = runs["float32", "torch"].steps
    long_prompt = PROMPT_LENS.index(max(PROMPT_LENS))
    chunks = [n for step in steps for i, n in step if i == long_prompt and n > 1]
    assert len(chunks) >= 2, f"the long prompt was not chunked: {steps[:3]}"
    assert any(any(n == 1 for _, n in step) and any(n > 1 for _, n in step) for step in steps), (
        f"no step mixed decodes and a prefill chunk: {steps[:3]}")


def test_fp32_torch_backend_matches_reference(runs: Runs, reference: Reference) -> None:
    run = runs["float32", "torch"]
    assert run.outputs == [ref.tokens for ref in reference.greedy]
    for i, (ours, ref) in enumerate(zip(run.logits, reference.greedy, strict=True)):
        diff = (ours - ref.logits).abs().max().item()
        assert diff < FP32_ATOL, f"prompt {i}: max |logit diff| {diff:.2e}"


@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
def test_bf16_matches_reference(runs: Runs, reference: Reference, prompts: list[list[int]],
                                backend: str) -> None:
    run = runs["bfloat16", backend]
    for i, prompt in enumerate(prompts):
        along = reference.logits_along(prompt, run.outputs[i])
        check_close(run.logits[i], along, f"bf16 {backend}, prompt {i}")
        check_parting(run.outputs[i], reference.greedy[i].tokens, along,
                      f"bf16 {backend} vs the reference, prompt {i}")


def test_flashinfer_agrees_with_torch_backend_bf16(runs: Runs, reference: Reference,
                                                   prompts: list[list[int]]) -> None:
    fi, tb = runs["bfloat16", "flashinfer"], runs["bfloat16", "torch"]
    assert fi.steps == tb.steps
    for i, prompt in enumerate(prompts):
        along = reference.logits_along(prompt, fi.outputs[i])
        check_parting(fi.outputs[i], tb.outputs[i], along, f"flashinfer vs torch, prompt {i}")
        same = first_difference(fi.outputs[i], tb.outputs[i])
        n = NUM_NEW if same is None else same + 1  # rows computed on the same prefix
        check_close(fi.logits[i][:n], tb.logits[i][:n], f"flashinfer vs torch bf16, prompt {i}")
