"""Rotary position embeddings of every kind the supported checkpoints ship, computed as
transformers computes them (modeling_rope_utils), so fp32 tables are bit-identical to HF's:

    default   inv_freq = 1 / theta^(2i/d)
    linear    inv_freq / factor                                   (position interpolation)
    llama3    long wavelengths / factor, short ones kept, a smooth ramp between (Llama 3.1+)
    yarn      per-dimension blend of interpolated and extrapolated frequencies, cos/sin x
              attention_factor (Qwen 2.5 long context, YaRN)
    dynamic   NTK-aware: past `max_position_embeddings` the base grows with the sequence length

Tables are `cos` and *signed* `sin` [positions, head_dim] in HF's rotate_half layout, with the
sign of rotate_half folded in: `signed_sin = [-sin | sin]`, so `rope(x) = x * cos +
swap_halves(x) * signed_sin` (engine/model.py `apply_rope`, kernels/_paged_attn.c).

Dynamic NTK depends on the sequence length, not only the position. HF recomputes the
frequencies whenever a forward pass reaches a longer sequence: a prompt of P tokens is rotated
with the frequencies of length max(P, max_position_embeddings), and the token decoded at
position p with those of length p + 1. Halfmoon does the same per request (`rope_lens`: the
length each token's frequencies are computed for), so its output matches HF's for a request
run alone; keys in the cache keep the rotation they were written with, as in HF.
"""

from __future__ import annotations

import math

import torch

from halfmoon.engine.model_config import ModelConfig, RopeSpec


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def inv_freq(spec: RopeSpec, dim: int, max_position: int, seq_len: int | None = None) -> torch.Tensor:
    """The inverse frequencies [dim / 2] (fp32) of `spec`; `seq_len` only matters for dynamic
    (the sequence length the frequencies are for; None: the trained length, i.e. unscaled)."""
    base = _base_inv_freq(spec.theta, dim)
    if spec.kind == "linear":
        return base / spec.factor
    if spec.kind == "llama3":
        return _llama3(spec, base)
    if spec.kind == "yarn":
        return _yarn(spec, dim)
    if spec.kind == "dynamic":
        trained = spec.original_max_position or max_position
        length = max(seq_len or trained, trained)
        theta = spec.theta * ((spec.factor * length / trained) - (spec.factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(theta, dim)
    return base


def _llama3(spec: RopeSpec, freq: torch.Tensor) -> torch.Tensor:
    old = spec.original_max_position
    low_wavelen, high_wavelen = old / spec.low_freq_factor, old / spec.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / spec.factor, freq)
    smooth = (old / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(spec: RopeSpec, dim: int) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(spec.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(spec.theta))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevents a singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = spec.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (spec.factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def tables_from(freq: torch.Tensor, positions: torch.Tensor, attention_factor: float,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [len(positions), 2 * len(freq)] in `dtype` (fp32 math, as HF)."""
    freqs = positions.float()[:, None] * freq[None, :]
    cos = torch.cat((freqs, freqs), dim=-1).cos()
    sin = torch.cat((-freqs, freqs), dim=-1).sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def rope_tables(spec: RopeSpec, cfg: ModelConfig, num_positions: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables for positions [0, num_positions) of `spec` (dynamic: its unscaled frequencies)."""
    freq = inv_freq(spec, cfg.head_dim, cfg.max_position)
    return tables_from(freq, torch.arange(num_positions), spec.attention_factor, dtype)


def dynamic_rows(spec: RopeSpec, cfg: ModelConfig, positions: torch.Tensor, rope_lens: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cos / signed sin rows [T, head_dim] of a dynamic RoPE: token t at `positions[t]`
    with the frequencies of sequence length `rope_lens[t]` (one table build per distinct length)."""
    t, d = positions.shape[0], cfg.head_dim
    cos, sin = torch.empty(t, d, dtype=dtype), torch.empty(t, d, dtype=dtype)
    lens = torch.clamp(rope_lens, min=spec.original_max_position or cfg.max_position)
    for length in torch.unique(lens).tolist():
        rows = (lens == length).nonzero().flatten()
        freq = inv_freq(spec, d, cfg.max_position, int(length))
        cos[rows], sin[rows] = tables_from(freq, positions[rows], spec.attention_factor, dtype)
    return cos, sin
