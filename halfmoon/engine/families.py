"""The model families Halfmoon serves: architecture -> config parsing, weight names, layer switches.

    family    HF model_type (architectures)           GGUF arch   what differs from Llama
    llama     llama (LlamaForCausalLM)                llama       rope_scaling: llama3, linear,
                                                                  dynamic, yarn
    mistral   mistral (MistralForCausalLM)            llama       sliding_window on every layer
    qwen2     qwen2 (Qwen2ForCausalLM)                qwen2       q/k/v bias; yarn; sliding layers
    qwen3     qwen3 (Qwen3ForCausalLM)                qwen3       q/k RMSNorm, explicit head_dim
    gemma3    gemma3_text (Gemma3ForCausalLM)         gemma3      local/global layers with their
                                                                  own RoPE, q/k norm, (1 + w)
                                                                  norms, sandwich norms,
                                                                  GELU-tanh, scaled embeddings

Everything downstream asks the `ModelConfig` this module builds (engine/model.py's layer
switches, the KV layout's heads / head_dim / windows, the block hash's fingerprint), never the
family name. A config Halfmoon cannot serve is refused here with `UnsupportedModelError` naming
what is missing (an architecture, MoE, a vision tower, an unknown rope type, softcapped
attention) — never a silent approximation.

Weights are named as in the HF checkpoints (`model.layers.N.self_attn.q_proj.weight`, ...), the
one naming every source is mapped to (engine/loader.py); `Family.layer_weights` lists each
layer's. Gemma's norms are stored as `w` and applied as `(1 + w)`: `Family.norm_offset` is added
once at load (engine/model.py), in fp32, exactly as HF's Gemma3RMSNorm computes `1.0 + w`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from halfmoon.engine.errors import ModelLoadError, UnsupportedModelError
from halfmoon.engine.model_config import ROPE_TYPES, ModelConfig, RopeSpec, yarn_attention_factor

_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")
_QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
_SANDWICH = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
_QKV_BIAS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
# HF config keys that mean experts (MoE): refused, whatever the family
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


@dataclass(frozen=True, slots=True)
class Family:
    """One architecture family: how to read its config and what its layers hold."""

    name: str
    model_types: tuple[str, ...]
    hf_architectures: tuple[str, ...]
    gguf_archs: tuple[str, ...]
    parse: Callable[[Mapping[str, Any], str], dict[str, Any]]  # HF config -> family switches
    norm_offset: float = 0.0  # added to every RMSNorm weight at load (Gemma: 1)
    gguf_permute_qk: bool = False  # llama.cpp permutes q/k rows of the "llama" arch only
    chat_template: str | None = None  # the family's template, for a source that ships none

    def layer_weights(self, cfg: ModelConfig) -> list[str]:
        """Every tensor (suffix after `model.layers.N.`) a layer of `cfg` must have."""
        names = [f"{n}.weight" for n in (*_ATTN, *_MLP, *_NORMS)]
        if cfg.qk_norm:
            names += [f"{n}.weight" for n in _QK_NORMS]
        if cfg.sandwich_norms:
            names += [f"{n}.weight" for n in _SANDWICH]
        if cfg.attention_bias:
            names += list(_QKV_BIAS)
        return names


def _windows(raw: Mapping[str, Any], sliding: str = "sliding_attention") -> tuple[int, ...]:
    """Per-layer windows from HF's `layer_types` (the v5 way) and `sliding_window`."""
    n, window = int(raw["num_hidden_layers"]), raw.get("sliding_window")
    types = raw.get("layer_types")
    if not window or types is None:
        return ()
    if len(types) != n:
        raise ModelLoadError(f"config.json: {len(types)} layer_types for {n} layers")
    unknown = set(types) - {sliding, "full_attention"}
    if unknown:
        raise UnsupportedModelError(f"layer types {sorted(unknown)} not supported (full_attention, {sliding})")
    return tuple(int(window) if t == sliding else 0 for t in types)


def _llama(raw: Mapping[str, Any], path: str) -> dict[str, Any]:
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise UnsupportedModelError(f"{path}: Llama with attention_bias / mlp_bias (o_proj or MLP biases) is not supported")
    return {}


def _mistral(raw: Mapping[str, Any], path: str) -> dict[str, Any]:
    window = raw.get("sliding_window")
    return {"layer_windows": (int(window),) * int(raw["num_hidden_layers"])} if window else {}


def _qwen2(raw: Mapping[str, Any], path: str) -> dict[str, Any]:
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    n = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if window and types is None:  # HF's rule when the config lists no layer types
        first = int(raw.get("max_window_layers", n))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return {"attention_bias": True,
            "layer_windows": _windows({**raw, "sliding_window": window, "layer_types": types})}


def _qwen3(raw: Mapping[str, Any], path: str) -> dict[str, Any]:
    if raw.get("attention_bias"):
        raise UnsupportedModelError(f"{path}: Qwen3 with attention_bias (o_proj bias) is not supported")
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    n = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if window and types is None:
        first = int(raw.get("max_window_layers", n))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return {"qk_norm": True, "layer_windows": _windows({**raw, "sliding_window": window, "layer_types": types})}


def _gemma3(raw: Mapping[str, Any], path: str) -> dict[str, Any]:
    if raw.get("attn_logit_softcapping"):
        raise UnsupportedModelError(f"{path}: attention logit softcapping is not supported")
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{path}: bidirectional attention (an embedding model) is not served")
    n, window = int(raw["num_hidden_layers"]), raw.get("sliding_window")
    types = raw.get("layer_types")
    if types is None:
        pattern = int(raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6)))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"{path}: hidden activation {act!r} not supported (gelu_pytorch_tanh)")
    return {
        "qk_norm": True, "sandwich_norms": True, "activation": "gelu_tanh",
        "embed_scale": float(raw["hidden_size"]) ** 0.5,
        "query_scale": float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
        "final_logit_softcap": raw.get("final_logit_softcapping"),
        "layer_windows": _windows({**raw, "layer_types": types}) if window else (),
    }


# Gemma 3's chat template as google/gemma-3-*-it ship it (tokenizer_config.json): its GGUFs carry
# none. It writes <bos> itself (Tokenizer.encode adds no second one).
GEMMA3_CHAT_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", ("llama",), ("LlamaForCausalLM",), ("llama",), _llama, gguf_permute_qk=True),
    Family("mistral", ("mistral",), ("MistralForCausalLM",), (), _mistral, gguf_permute_qk=True),
    Family("qwen2", ("qwen2",), ("Qwen2ForCausalLM",), ("qwen2",), _qwen2),
    Family("qwen3", ("qwen3",), ("Qwen3ForCausalLM",), ("qwen3",), _qwen3),
    Family("gemma3", ("gemma3_text",), ("Gemma3ForCausalLM",), ("gemma3",), _gemma3, norm_offset=1.0,
           chat_template=GEMMA3_CHAT_TEMPLATE),
)}
SUPPORTED = ", ".join(f"{f.name} ({'/'.join(f.model_types)})" for f in FAMILIES.values())


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise UnsupportedModelError(f"model family {name!r} not supported; supported: {SUPPORTED}") from None


def hf_family(raw: Mapping[str, Any], path: str) -> Family:
    """The family of a HF config, or the one clear refusal (MoE, vision tower, unknown)."""
    model_type = raw.get("model_type")
    arch = (raw.get("architectures") or [None])[0]
    moe = [k for k in _MOE_KEYS if raw.get(k)]
    if moe or "moe" in str(model_type) or model_type == "mixtral":
        raise UnsupportedModelError(f"{path}: mixture-of-experts models are not supported "
                                    f"(model_type {model_type!r}, {', '.join(moe) or 'experts'})")
    if raw.get("vision_config") is not None or "ConditionalGeneration" in str(arch):
        raise UnsupportedModelError(f"{path}: model_type {model_type!r} ({arch}) has a vision tower; Halfmoon "
                                    f"serves text-only checkpoints ({SUPPORTED})")
    for fam in FAMILIES.values():
        if model_type in fam.model_types or (model_type is None and arch in fam.hf_architectures):
            return fam
    raise UnsupportedModelError(f"{path}: model_type {model_type!r} ({arch}) not supported; supported: {SUPPORTED}")


def parse_rope(params: Mapping[str, Any] | None, theta: float, max_position: int,
               path: str) -> RopeSpec | None:
    """A HF `rope_parameters` / `rope_scaling` dict -> RopeSpec (None: plain RoPE of `theta`)."""
    if not params:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", theta))
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(f"{path}: rope type {kind!r} not supported (supported: {', '.join(ROPE_TYPES)})")
    if kind == "default":
        return RopeSpec(theta)
    factor = params.get("factor")
    original = int(params.get("original_max_position_embeddings") or max_position)
    if kind == "yarn" and factor is None:
        factor = max_position / original
    if factor is None:
        raise ModelLoadError(f"{path}: rope type {kind!r} without a factor")
    factor = float(factor)
    if kind == "dynamic":
        original = max_position  # HF scales past max_position_embeddings
    attention = 1.0
    if kind == "yarn":
        attention = params.get("attention_factor") or yarn_attention_factor(
            factor, params.get("mscale"), params.get("mscale_all_dim"))
    return RopeSpec(theta, kind, factor, original,
                    low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                    high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                    beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                    attention_factor=float(attention), truncate=bool(params.get("truncate", True)))


def _rope_fields(raw: Mapping[str, Any], fam: Family, max_position: int, path: str) -> dict[str, Any]:
    """rope_theta, rope_scaling and (Gemma 3) local_rope_theta, from either config format: v5's
    `rope_parameters` (nested per layer type when they differ) or v4's rope_theta + rope_scaling
    (+ rope_local_base_freq)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling")
    theta = float(raw.get("rope_theta") or 10000.0)
    local: float | None = None
    if params and "full_attention" in params:  # nested by layer type
        sliding = params.get("sliding_attention") or {}
        params = params["full_attention"]
        local_spec = parse_rope(sliding, theta, max_position, path)
        if local_spec is not None and local_spec.kind != "default":
            raise UnsupportedModelError(f"{path}: scaled RoPE on sliding layers ({local_spec.kind}) is not supported")
        local = local_spec.theta if local_spec is not None else None
    elif fam.name == "gemma3":
        theta = float(raw.get("rope_theta") or 1_000_000.0)
        local = float(raw.get("rope_local_base_freq") or 10000.0)
    spec = parse_rope(params, theta, max_position, path)
    if spec is not None:
        theta = spec.theta
    scaling = spec if spec is not None and spec.kind != "default" else None
    if fam.name == "gemma3" and local is None:
        local = 10000.0
    return {"rope_theta": theta, "rope_scaling": scaling, "local_rope_theta": local}


def max_positions(max_position_embeddings: int, rope: RopeSpec | None) -> int:
    """The positions a model may run to: past `max_position_embeddings` where the scaling is
    made for it (dynamic NTK; YaRN's original context x factor), else as configured."""
    if rope is None:
        return max_position_embeddings
    if rope.kind in ("dynamic", "yarn"):
        return max(max_position_embeddings, int(math.ceil(rope.original_max_position * rope.factor)))
    return max_position_embeddings


def config_from_hf(raw: Mapping[str, Any], path: Path, generation: Mapping[str, Any] | None = None) -> ModelConfig:
    """A HF `config.json` (and `generation_config.json`) -> ModelConfig, or a clear refusal."""
    where = str(path)
    fam = hf_family(raw, where)
    try:
        heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
        max_pos = int(raw.get("max_position_embeddings", 2048))
        rope = _rope_fields(raw, fam, max_pos, where)
        switches = fam.parse(raw, where)
        eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id", 2))
        eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        bos = (generation or {}).get("bos_token_id", raw.get("bos_token_id"))
        return ModelConfig(
            architecture=fam.name,
            num_layers=int(raw["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position=max_positions(max_pos, rope["rope_scaling"]),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", fam.name == "gemma3")),
            bos_id=int(bos) if bos is not None else None,
            eos_id=eos_ids[0],
            extra_eos_ids=tuple(eos_ids[1:]),
            source_id=f"hf:{path.name}:{raw.get('_name_or_path', '')}",
            **rope, **switches,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{where}/config.json: {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------- GGUF metadata

# llama.cpp architectures that are mixtures of experts (a "llama" file with `llama.expert_count`,
# Mixtral's, is caught by that key)
_GGUF_MOE_ARCHS = ("qwen2moe", "qwen3moe", "deepseek2", "dbrx", "olmoe", "granitemoe", "llama4", "arctic",
                   "grok", "phimoe", "gpt-oss", "mixtral")
SUPPORTED_GGUF = ", ".join(sorted({a for f in FAMILIES.values() for a in f.gguf_archs}))
# llama.cpp's Gemma 3 constants that its GGUFs do not store (src/llama-model.cpp)
_GEMMA3_LOCAL_ROPE = 10000.0
_GEMMA3_SLIDING_PATTERN = 6  # every 6th layer global
_GEMMA3_27B_LAYERS = 62  # the 27B scales queries by hidden / heads, the others by head_dim


def gguf_family(arch: str | None, path: str) -> Family:
    """The family of a GGUF `general.architecture`, or the one clear refusal."""
    if arch in _GGUF_MOE_ARCHS or "moe" in str(arch):
        raise UnsupportedModelError(f"{path}: mixture-of-experts models are not supported (GGUF architecture {arch!r})")
    for fam in FAMILIES.values():
        if arch in fam.gguf_archs:
            return fam
    raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} not supported; supported: {SUPPORTED_GGUF}")


class _Meta:
    """`{arch}.*` metadata of one GGUF header, with the errors naming the key."""

    def __init__(self, reader: Any, arch: str, path: str) -> None:
        self.fields, self.arch, self.path = reader.fields, arch, path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(f"{self.arch}.{key}")
        return default if field is None else field.contents()

    def req(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata {self.arch}.{key} missing")
        return value

    def one(self, key: str, default: Any = None) -> Any:
        """A per-layer value some files store as a list: refused unless all layers agree."""
        value = self.get(key, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise UnsupportedModelError(f"{self.path}: per-layer {self.arch}.{key} {value[:4]}... not supported")
            value = value[0]
        return value


def _gguf_rope(meta: _Meta, theta: float, max_position: int, rope_freqs: Any) -> RopeSpec | None:
    """`{arch}.rope.scaling.*` (or Llama 3's `rope_freqs` tensor) -> the global layers' RopeSpec."""
    kind = meta.get("rope.scaling.type")
    if rope_freqs is not None:
        return _llama3_from_factors(rope_freqs, theta, meta)
    if kind in (None, "none") or (kind == "linear" and float(meta.get("rope.scaling.factor", 1.0)) == 1.0):
        return None
    params = {"rope_type": kind, "factor": meta.get("rope.scaling.factor"),
              "original_max_position_embeddings": meta.get("rope.scaling.original_context_length"),
              "beta_fast": meta.get("rope.scaling.yarn_beta_fast"), "beta_slow": meta.get("rope.scaling.yarn_beta_slow")}
    attention = meta.get("rope.scaling.yarn_attn_factor") or meta.get("rope.scaling.attn_factor")
    if kind == "yarn" and attention and float(attention) != 1.0:
        params["attention_factor"] = float(attention)
    return parse_rope({k: v for k, v in params.items() if v is not None}, theta, max_position, meta.path)


def _llama3_from_factors(factors: Any, theta: float, meta: _Meta) -> RopeSpec:
    """Llama 3.1+'s RoPE from the per-frequency divisors llama.cpp stores as `rope_freqs.weight`
    (its converter drops the parameters): factor = the largest divisor, low/high_freq_factor 1
    and 4 (every Llama 3.x), the original context solved from the first ramp dimension; the
    divisors this spec gives must equal the file's, else the file is refused."""
    import torch

    from halfmoon.engine import rope as rope_mod

    got = torch.as_tensor(factors, dtype=torch.float32).reshape(-1)
    dim, factor = 2 * got.numel(), float(got.max())
    base = rope_mod.inv_freq(RopeSpec(theta), dim, 0)
    ramp = [i for i, f in enumerate(got.tolist()) if 1.0 < f < factor]
    if factor > 1.0 and ramp:
        wavelen = 2 * math.pi / float(base[ramp[0]])
        smooth = (1.0 / float(got[ramp[0]]) - 1.0 / factor) / (1.0 - 1.0 / factor)
        spec = RopeSpec(theta, "llama3", factor, round(wavelen * (3.0 * smooth + 1.0)))
        if torch.allclose(base / rope_mod.inv_freq(spec, dim, 0), got, rtol=1e-4, atol=0.0):
            return spec
    raise UnsupportedModelError(f"{meta.path}: rope_freqs tensor {got[:4].tolist()}... is not Llama 3's RoPE "
                                "scaling (low/high_freq_factor 1 and 4); not supported")


def _gguf_switches(fam: Family, meta: _Meta, cfg: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """The family switches a GGUF implies: its tensors say bias / q-k norms, llama.cpp's
    defaults give Gemma 3's rest."""
    n, window = cfg["num_layers"], meta.get("attention.sliding_window")
    out: dict[str, Any] = {"attention_bias": "blk.0.attn_q.bias" in names,
                           "qk_norm": "blk.0.attn_q_norm.weight" in names}
    if fam.name != "gemma3":
        if window:  # a Mistral with its window, or a Qwen file that states one for every layer
            out["layer_windows"] = (int(window),) * n
        return out
    pattern = meta.get("attention.sliding_window_pattern", _GEMMA3_SLIDING_PATTERN)
    sliding = pattern if isinstance(pattern, list) else [(i + 1) % int(pattern) != 0 for i in range(n)]
    scalar = cfg["hidden_size"] / cfg["num_heads"] if n == _GEMMA3_27B_LAYERS else cfg["head_dim"]
    return {**out, "sandwich_norms": True, "activation": "gelu_tanh",
            "embed_scale": float(cfg["hidden_size"]) ** 0.5, "query_scale": float(scalar) ** -0.5,
            "final_logit_softcap": meta.get("final_logit_softcapping"),
            "local_rope_theta": _GEMMA3_LOCAL_ROPE,
            "layer_windows": tuple(int(window) if s else 0 for s in sliding) if window else ()}


def config_from_gguf(reader: Any, path: Path, rope_freqs: Any = None) -> ModelConfig:
    """A GGUF header's metadata (engine/gguf_header.py or gguf.GGUFReader) -> ModelConfig, or a
    clear refusal. `rope_freqs`: the file's `rope_freqs.weight` values, when it has one."""
    where = str(path)

    def top(key: str, default: Any = None) -> Any:
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = top("general.architecture")
    fam = gguf_family(arch, where)
    meta = _Meta(reader, arch, where)
    if meta.get("expert_count"):
        raise UnsupportedModelError(f"{where}: mixture-of-experts models are not supported "
                                    f"({arch}.expert_count = {meta.get('expert_count')})")
    if meta.get("attn_logit_softcapping"):
        raise UnsupportedModelError(f"{where}: attention logit softcapping is not supported")
    names = {t.name for t in reader.tensors}
    try:
        hidden, heads = int(meta.req("embedding_length")), int(meta.one("attention.head_count"))
        head_dim = meta.get("attention.key_length") or meta.get("rope.dimension_count") or hidden // heads
        max_pos = int(meta.req("context_length"))
        theta = float(meta.get("rope.freq_base", 1_000_000.0 if fam.name == "gemma3" else 10000.0))
        rope = _gguf_rope(meta, theta, max_pos, rope_freqs)
        vocab = meta.get("vocab_size") or len(top("tokenizer.ggml.tokens") or ())
        shape = {"num_layers": int(meta.req("block_count")), "hidden_size": hidden, "num_heads": heads,
                 "head_dim": int(head_dim)}
        switches = _gguf_switches(fam, meta, shape, names)
        bos = top("tokenizer.ggml.bos_token_id")
        windowed = fam.name == "llama" and bool(switches.get("layer_windows"))
        return ModelConfig(
            architecture="mistral" if windowed else fam.name,
            **shape,
            num_kv_heads=int(meta.one("attention.head_count_kv", heads)),
            intermediate_size=int(meta.one("feed_forward_length")),
            vocab_size=int(vocab),
            rope_theta=rope.theta if rope is not None else theta,
            rope_scaling=rope,
            rms_norm_eps=float(meta.req("attention.layer_norm_rms_epsilon")),
            max_position=max_positions(max_pos, rope),
            tie_word_embeddings="output.weight" not in names,
            bos_id=int(bos) if bos is not None else None,
            eos_id=int(top("tokenizer.ggml.eos_token_id", 2)),
            source_id=f"gguf:{path.name}:{path.stat().st_size}",
            **switches,
        )
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{where}: GGUF metadata: {type(e).__name__}: {e}") from e
