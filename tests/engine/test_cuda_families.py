"""Every family on CUDA (deploy/gpu_check.sh runs it; skipped without a CUDA device): the tiny
checkpoints of tests/model_families.py, with head_dim 64 (a size FlashInfer's kernels are built
for), greedy on the GPU with the torch and the flashinfer attention backends, token-identical to
transformers fp32 on the CPU. Sliding windows, per-layer RoPE, q/k norms and biases all run on
the device path there."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest import mock

import pytest
import torch

import halfmoon.engine.engine as engine_module
from halfmoon.core.params import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.engine.loader import load_weights
from tests.model_families import CASES, NEW, FamilyCase, build_checkpoint, hf_greedy, prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="runs the families on CUDA; this machine has no CUDA device"),
    pytest.mark.timeout(420),
]
# head_dim 64 everywhere: FlashInfer's paged kernels are built for 64 / 128 / 256
WIDE = {"head_dim": 64}


def wide(case: FamilyCase) -> FamilyCase:
    return dataclasses.replace(case, kwargs={**case.kwargs, **WIDE})


def cuda_greedy(folder: Path, backend: str, prompt_ids: list[list[int]]) -> list[list[int]]:
    loaded = load_weights(str(folder))
    on_gpu = dataclasses.replace(loaded, weights={k: v.cuda() for k, v in loaded.weights.items()})
    with torch.device("cuda"), mock.patch.object(engine_module, "load_weights", return_value=on_gpu):
        engine = Engine(EngineConfig(model=str(folder), num_blocks=64, max_num_batched_tokens=32,
                                     attention_backend=backend))
        assert engine.kv_cache.device.type == "cuda"
        results = engine.generate(prompt_ids, SamplingParams(max_tokens=NEW, ignore_eos=True))
    return [r.output_ids for r in results]


@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_family_on_cuda_is_token_identical_to_transformers(case: FamilyCase, backend: str, tmp_path: Path) -> None:
    case = wide(case)
    model = build_checkpoint(case, tmp_path / case.name)
    ids = prompts(2)
    expected = [hf_greedy(model, p) for p in ids]
    assert cuda_greedy(tmp_path / case.name, backend, ids) == expected
