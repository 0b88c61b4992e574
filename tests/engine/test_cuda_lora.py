"""LoRA adapters on CUDA: the slots, the per-step row groups and the two batched matmuls per
projection run on the device (engine/lora_pool.py); a step with an adapter runs eagerly (the
decode graphs hold no adapter), a base-model step still replays its graph. fp32 greedy tokens
equal transformers + peft's, as on CPU (tests/engine/test_lora.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from halfmoon.core.adapters import AdapterRef
from halfmoon.core.params import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.engine.lora import read_files
from tests.lora_support import make_adapter, peft_greedy
from tests.model_families import BY_NAME, build_checkpoint, hf_greedy, prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="runs LoRA adapters on CUDA; this machine has no CUDA device"),
]
NEW = 16


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_adapters_and_the_base_model_in_one_batch_on_cuda(family: str, tmp_path: Path) -> None:
    case = BY_NAME[family]
    base = build_checkpoint(case, tmp_path / "base")
    ps = prompts(2)
    refs, expected = [], []
    for i, rank in enumerate((8, 4)):
        model = make_adapter(case, tmp_path / f"a{i}", seed=200 + i, rank=rank, base_name=str(tmp_path / "base"))
        refs.append(AdapterRef(f"a{i}", str(tmp_path / f"a{i}"), read_files(tmp_path / f"a{i}", f"a{i}").digest))
        expected.append([peft_greedy(model, p, NEW) for p in ps])
    base_expected = [hf_greedy(base, p, NEW) for p in ps]
    engine = Engine(EngineConfig(model=str(tmp_path / "base"), device="cuda", num_blocks=64,
                                 max_num_batched_tokens=32))
    assert engine.lora is not None and engine.kv_cache.is_cuda
    params = [SamplingParams(max_tokens=NEW, ignore_eos=True, adapter=ref) for ref in (*refs, None) for _ in ps]
    got = [r.output_ids for r in engine.generate(ps * 3, params)]
    assert got == [*expected[0], *expected[1], *base_expected]
    assert all(t.is_cuda for t in engine.lora.a.values())
    engine.lora.check()
