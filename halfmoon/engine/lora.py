"""LoRA adapters: PEFT folders read, checked against the base model, and laid out for the pool.

A PEFT LoRA folder is `adapter_config.json` + `adapter_model.safetensors` with, per adapted
module, `...layers.{i}.{self_attn|mlp}.{module}.lora_A.weight` [r, in] and `lora_B.weight`
[out, r]; the module's output gains `scaling * B @ A @ x`, scaling = alpha / r (alpha / sqrt(r)
with `use_rslora`; `alpha_pattern` / `rank_pattern` per module as PEFT matches them).

The engine fuses q/k/v and gate/up (engine/model.py), so an adapter is stored as one shrink per
fused projection and one expand per module, per layer:

    qkv:     A [in, 3R] = [A_q^T | A_k^T | A_v^T]      B_q [R, q], B_k [R, kv], B_v [R, kv]
    o:       A [in, R]                                 B_o [R, hidden]
    gate_up: A [in, 2R] = [A_gate^T | A_up^T]          B_gate [R, inter], B_up [R, inter]
    down:    A [in, R]                                 B_down [R, hidden]

(scaling folded into B). R is the engine's `max_lora_rank`: a module of rank r < R fills r of its
R rows (the rest are zeros), a module the adapter leaves alone is all zeros. So every adapter has
the same shapes and a mixed batch multiplies each projection's rows by their own adapter in one
batched shrink and one batched expand per module (engine/lora_pool.py). A decode step reads each
adapter's A and B once: no block-diagonal zeros (they were 1/3 of what a step read).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from halfmoon.core.adapters import TARGET_MODULES, InvalidAdapterError, LoraShapes
from halfmoon.engine.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the engine's fused projections and the PEFT modules stacked in each, in output order
PROJECTIONS: Mapping[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\."
                  r"(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# configuration PEFT can write that this engine does not serve, and why
_REFUSED = (("use_dora", "DoRA adapters are not served (use_dora: true); merge them or train plain LoRA"),
            ("fan_in_fan_out", "fan_in_fan_out adapters (GPT-2 Conv1D layers) do not fit these families"))


def lora_shapes(cfg: ModelConfig, base_names: tuple[str, ...] = ()) -> LoraShapes:
    """The (in, out) features of every LoRA target module of `cfg`."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    dims = {"q_proj": (h, cfg.q_size), "k_proj": (h, cfg.kv_size), "v_proj": (h, cfg.kv_size),
            "o_proj": (cfg.q_size, h), "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    return LoraShapes(cfg.num_layers, tuple((m, *dims[m]) for m in TARGET_MODULES), base_names)


@dataclass(frozen=True, slots=True)
class AdapterFiles:
    """An adapter folder's two files, read once: their digest and the parsed contents."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    digest: str
    nbytes: int


def read_files(path: str | Path, name: str) -> AdapterFiles:
    """Read `path`'s config and weights; InvalidAdapterError when either is missing or unreadable."""
    from safetensors.torch import load as load_safetensors

    folder = Path(path)
    if not folder.is_dir():
        raise InvalidAdapterError(name, f"{folder} is not a folder (a PEFT adapter is a folder with "
                                        f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        raw_config = (folder / CONFIG_FILE).read_bytes()
    except OSError as e:
        raise InvalidAdapterError(name, f"cannot read {folder / CONFIG_FILE}: {e.strerror or e}") from e
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        hint = " (adapter_model.bin: convert it to safetensors)" if (folder / "adapter_model.bin").is_file() else ""
        raise InvalidAdapterError(name, f"no {WEIGHTS_FILE} in {folder}{hint}")
    raw_weights = weights.read_bytes()
    try:
        config = json.loads(raw_config)
    except ValueError as e:
        raise InvalidAdapterError(name, f"{CONFIG_FILE} is not JSON: {e}") from e
    if not isinstance(config, dict):
        raise InvalidAdapterError(name, f"{CONFIG_FILE} must hold a JSON object")
    try:
        tensors = load_safetensors(raw_weights)
    except Exception as e:  # safetensors raises its own SafetensorError for a damaged file
        raise InvalidAdapterError(name, f"{WEIGHTS_FILE} is not a readable safetensors file: {e}") from e
    digest = hashlib.sha256(hashlib.sha256(raw_config).digest() + hashlib.sha256(raw_weights).digest()).hexdigest()
    return AdapterFiles(config, tensors, digest[:32], len(raw_config) + len(raw_weights))


@dataclass(frozen=True, slots=True)
class ModuleLora:
    """One adapted module of one layer: A [r, in], B [out, r], its scaling."""

    layer: int
    module: str
    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """A checked adapter: its modules, rank (the largest of its modules') and digest."""

    name: str
    digest: str
    rank: int
    modules: tuple[ModuleLora, ...]
    targets: tuple[str, ...]
    base_model: str
    nbytes: int


def check_adapter(files: AdapterFiles, name: str, shapes: LoraShapes, max_rank: int) -> AdapterSpec:
    """The adapter in `files` if this base model can serve it; InvalidAdapterError naming the one
    reason otherwise (PEFT type, refused options, target modules, shapes, rank, base model)."""
    cfg = files.config
    _check_options(cfg, name)
    _check_base(str(cfg.get("base_model_name_or_path") or ""), shapes.base_names, name)
    pairs = _pairs(files.tensors, name)
    modules = []
    for (layer, module), (a, b) in sorted(pairs.items()):
        _check_shapes(name, layer, module, a, b, shapes, max_rank)
        alpha = _pattern(cfg.get("alpha_pattern"), layer, module, cfg.get("lora_alpha", 8))
        r = a.shape[0]
        scaling = float(alpha) / (math.sqrt(r) if cfg.get("use_rslora") else r)
        modules.append(ModuleLora(layer, module, a.float(), b.float(), scaling))
    if not modules:
        raise InvalidAdapterError(name, f"{WEIGHTS_FILE} holds no LoRA weights")
    return AdapterSpec(name, files.digest, max(m.rank for m in modules), tuple(modules),
                       tuple(sorted({m.module for m in modules}, key=TARGET_MODULES.index)),
                       str(cfg.get("base_model_name_or_path") or ""), files.nbytes)


def _check_options(cfg: Mapping[str, Any], name: str) -> None:
    kind = cfg.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise InvalidAdapterError(name, f"peft_type {kind!r} is not served (LoRA adapters only)")
    for key, why in _REFUSED:
        if cfg.get(key):
            raise InvalidAdapterError(name, why)
    if cfg.get("bias", "none") != "none":
        raise InvalidAdapterError(name, f"bias {cfg['bias']!r} trains the base model's biases; only bias "
                                        "'none' adapters are served")
    if cfg.get("modules_to_save"):
        raise InvalidAdapterError(name, f"modules_to_save {cfg['modules_to_save']} replaces whole base "
                                        "modules; only LoRA weights are served")
    targets = cfg.get("target_modules")
    listed = [targets] if isinstance(targets, str) else list(targets or ())
    bad = [t for t in listed if t not in TARGET_MODULES and t != "all-linear" and not re.search(r"[\\^$*+?()\[\]|]", t)]
    if bad:
        raise InvalidAdapterError(name, f"target modules {bad} are not served (LoRA on {', '.join(TARGET_MODULES)})")


def normalized_name(name: str) -> str:
    """A model name as compared with an adapter's base: folder or repo basename, lower case,
    without a file extension or a quantization suffix (SmolLM2-135M-Instruct-Q8_0.gguf ->
    smollm2-135m-instruct)."""
    stem = name.rstrip("/").rsplit("/", 1)[-1].lower()
    stem = re.sub(r"\.(gguf|safetensors|bin)$", "", stem)
    while True:
        shorter = re.sub(r"[-_.](q\d(_[a-z0-9]+)*|iq\d\w*|f16|f32|bf16|fp16|fp32|gguf|int[48])$", "", stem)
        if shorter == stem:
            return stem
        stem = shorter


def base_names(model: str, weights: Any) -> tuple[str, ...]:
    """The names the served model goes by (LoadedWeights `weights`): the `--model` given, its
    file or folder, a HF config's `_name_or_path`, a GGUF's `{basename}-{size_label}`."""
    names = [model, weights.path.name]
    if weights.fmt == "hf":
        try:
            names.append(json.loads((weights.path / "config.json").read_text()).get("_name_or_path") or "")
        except (OSError, ValueError):
            pass
    elif weights.gguf_reader is not None:
        from halfmoon.engine.loader import gguf_field

        basename, size = gguf_field(weights.gguf_reader, "general.basename"), gguf_field(weights.gguf_reader, "general.size_label")
        if basename and size:
            names.append(f"{basename}-{size}")
    return tuple(dict.fromkeys(n for n in names if n))


def same_model(a: str, b: str) -> bool:
    """Whether two model names name the same base: equal once normalized, or one a dash-suffixed
    variant of the other (smollm2-135m / smollm2-135m-instruct, gemma-3-270m / gemma-3-270m-it)."""
    x, y = normalized_name(a), normalized_name(b)
    return x == y or x.startswith(y + "-") or y.startswith(x + "-")


def _check_base(adapter_base: str, served: tuple[str, ...], name: str) -> None:
    """The adapter's base model must be the served one, when both names are known."""
    if not adapter_base or not served:
        return
    if any(same_model(adapter_base, s) for s in served):
        return
    raise InvalidAdapterError(name, f"it was trained on {adapter_base!r}, this cluster serves {served[0]!r} "
                                    "(base_model_name_or_path in adapter_config.json; --lora-skip-base-check "
                                    "serves it anyway when the shapes fit)")


def _pairs(tensors: Mapping[str, torch.Tensor], name: str) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A, B), every key accounted for."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise InvalidAdapterError(name, f"tensor {key!r} is not a LoRA weight of a decoder layer's "
                                            f"projection (served: {', '.join(TARGET_MODULES)})")
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGET_MODULES:
            raise InvalidAdapterError(name, f"target module {module!r} is not served (LoRA on "
                                            f"{', '.join(TARGET_MODULES)})")
        halves.setdefault((layer, module), {})[half] = t
    out = {}
    for (layer, module), ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise InvalidAdapterError(name, f"layer {layer} {module} has lora_{next(iter(ab))} without "
                                            f"lora_{'B' if 'A' in ab else 'A'}")
        out[(layer, module)] = (ab["A"], ab["B"])
    return out


def _check_shapes(name: str, layer: int, module: str, a: torch.Tensor, b: torch.Tensor,
                  shapes: LoraShapes, max_rank: int) -> None:
    if not 0 <= layer < shapes.num_layers:
        raise InvalidAdapterError(name, f"it adapts layer {layer}; the base model has {shapes.num_layers} layers")
    fan_in, fan_out = shapes.features(module)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape[0] != fan_out or a.shape[0] != b.shape[1]:
        raise InvalidAdapterError(name, f"layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} "
                                        f"do not fit the base model's [{fan_out}, {fan_in}] weight")
    if not 0 < a.shape[0] <= max_rank:
        raise InvalidAdapterError(name, f"rank {a.shape[0]} (layer {layer} {module}) is over this cluster's "
                                        f"--max-lora-rank {max_rank}")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise InvalidAdapterError(name, f"layer {layer} {module} holds NaN or infinite weights")


def _pattern(patterns: Mapping[str, Any] | None, layer: int, module: str, default: Any) -> Any:
    """PEFT's per-module override (`alpha_pattern`, `rank_pattern`): the first key matching the
    module's name `layers.{layer}.{...}.{module}` as a regex suffix, else `default`."""
    if not patterns:
        return default
    group = "self_attn" if module in PROJECTIONS["qkv"] + PROJECTIONS["o"] else "mlp"
    full = f"model.layers.{layer}.{group}.{module}"
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", full):
            return value
    return default


@dataclass(frozen=True, slots=True)
class StackedLora:
    """An adapter in the pool's layout (module docstring): per fused projection A [L, in, k*R],
    per module B [L, R, out] (k = the projection's modules, R = the pool's rank; scaling in B)."""

    spec: AdapterSpec
    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]


def projection_dims(shapes: LoraShapes) -> dict[str, tuple[int, int]]:
    """(in features, stacked modules) of each fused projection."""
    return {proj: (shapes.features(modules[0])[0], len(modules)) for proj, modules in PROJECTIONS.items()}


def module_columns(shapes: LoraShapes) -> dict[str, tuple[tuple[str, int, int], ...]]:
    """Per fused projection, each module's output columns in it: (module, first, end)."""
    out = {}
    for proj, modules in PROJECTIONS.items():
        cols, start = [], 0
        for module in modules:
            end = start + shapes.features(module)[1]
            cols.append((module, start, end))
            start = end
        out[proj] = tuple(cols)
    return out


def stack(spec: AdapterSpec, shapes: LoraShapes, rank: int, dtype: torch.dtype) -> StackedLora:
    """`spec` laid out for a pool of rank `rank` (module docstring)."""
    n = shapes.num_layers
    a = {p: torch.zeros(n, fan_in, k * rank) for p, (fan_in, k) in projection_dims(shapes).items()}
    b = {m: torch.zeros(n, rank, shapes.features(m)[1]) for m in TARGET_MODULES}
    where = {m: (proj, k) for proj, modules in PROJECTIONS.items() for k, m in enumerate(modules)}
    for m in spec.modules:
        proj, k = where[m.module]
        a[proj][m.layer, :, k * rank : k * rank + m.rank] = m.a.T
        b[m.module][m.layer, : m.rank] = m.b.T * m.scaling
    return StackedLora(spec, {p: t.to(dtype) for p, t in a.items()}, {m: t.to(dtype) for m, t in b.items()})
