"""A decode step's layer glue as a few native calls (kernels/_fused.c, kernels/_paged_attn.c).

At batch 1-32 a decoder layer's time outside its four matmuls is Python and torch dispatch, not
arithmetic: `engine/model.py`'s `_layer` issues ~20 torch calls (~55 ATen ops: F.rms_norm alone
is decomposed into ~20 in this torch). For an all-decode step on CPU the layer becomes

    h = add_rms_norm(x += delta)           _fused.add_rms_norm   (delta: the previous layer's MLP)
    qkv = qkv_proj(h)
    rope(q, k); cache[slot] = k, v; attend  _paged_attn.decode_rope -> attn_out
    h = add_rms_norm(x += o_proj(attn_out)) _fused.add_rms_norm
    delta = down(silu_mul(gate_up(h)))     _fused.silu_mul (a few rows; else F.silu + mul_)

Numerics (tests/kernels/test_fused.py holds each call against the torch composition): RoPE and
the residual adds are bit-identical to torch in fp32 and bf16 (same products, same roundings);
the norm and SiLU use their own reduction order and e^x, so they differ from torch by a few fp32
ulp (bf16: occasionally one bf16 ulp). The fused path runs in fp32 too: decode logits already
differ from transformers' by ~1e-4 (paged, batched attention), and tests/engine's greedy-token
and logit checks pass with it. Prefill and mixed steps keep the torch path, so a prefill's logits
stay bit-identical to transformers'.

Without the extensions (no C compiler at install) a loud warning at import, and every step takes
the torch path; so do CUDA tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.attention import AttentionMetadata

log = logging.getLogger(__name__)

try:
    from kernels import _fused, _paged_attn
except ImportError as e:  # built at install (setup.py); missing without a C compiler
    _fused = _paged_attn = None
    log.warning(
        "kernels._fused or kernels._paged_attn is not built (%s): every decode step runs ~3x "
        "the torch calls per layer (norms, RoPE, KV write, SiLU as separate ops; ~4-6 ms a step "
        "for SmolLM2 on a small CPU). Build them with `python setup.py build_ext --inplace`.", e)

AVAILABLE = _fused is not None and _paged_attn is not None
_DTYPES = (torch.float32, torch.bfloat16)
# the native attention's limits (kernels/_paged_attn.c)
MAX_HEAD_DIM, MAX_GROUP = 256, 16
# _fused.silu_mul beats F.silu + mul_ up to ~2 rows of 1536 (bf16: 5.2 vs 9.0 us a row on a
# 2-core AVX2 EPYC) and loses from ~4 (bf16) / ~8 (fp32) rows on: ATen's e^x loop is faster.
NATIVE_ACT_MAX_ELEMENTS = 4096


def weights_supported(weights: list[torch.Tensor], dtype: torch.dtype) -> bool:
    """Whether the native calls can read these norm weights: contiguous CPU `dtype` (fp32 or
    bf16) vectors. Checked once per model; `supported` checks each step's tensors."""
    return AVAILABLE and dtype in _DTYPES and all(
        w.device.type == "cpu" and w.dtype == dtype and w.dim() == 1 and w.is_contiguous()
        for w in weights)


def supported(x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, num_heads: int,
              rope: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether this step can run natively: an all-decode CPU step, fp32/bf16 throughout, the
    cache and RoPE tables contiguous, int64 step inputs (the norm weights: `weights_supported`)."""
    dec = meta.decode
    if not AVAILABLE or dec is None or dec.num != meta.num_tokens or meta.prefills:
        return False
    head_dim, kv_heads = kv_cache.shape[-1], kv_cache.shape[-2]
    tensors = (x, kv_cache, *rope)
    return (x.device.type == "cpu" and x.dtype in _DTYPES and x.is_contiguous()
            and all(t.dtype == x.dtype and t.device == x.device and t.is_contiguous()
                    for t in tensors)
            and head_dim % 2 == 0 and head_dim <= MAX_HEAD_DIM
            and num_heads % kv_heads == 0 and num_heads // kv_heads <= MAX_GROUP
            and dec.block_tables.dtype == dec.ctx_lens.dtype == torch.int64
            and meta.slot_mapping.dtype == torch.int64
            and dec.block_tables.stride(1) == 1 and dec.ctx_lens.is_contiguous()
            and meta.slot_mapping.is_contiguous())


class DecodeStep:
    """One all-decode step's native calls. The addresses every layer shares (step inputs, RoPE
    tables, output buffers) are taken once here; each call then passes only what changes.

    `x` (the residual stream, [T, hidden]) is updated in place; `h` and `attn_out` are this
    step's buffers, overwritten by each call that returns them.
    """

    __slots__ = ("x", "h", "attn_out", "_act", "_dtype", "_bf16", "_eps", "_threads", "_profiling",
                 "_attn_tail", "_cache", "_layer_bytes", "_qkv_width")

    def __init__(self, x: torch.Tensor, positions: torch.Tensor,
                 rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                 meta: AttentionMetadata, num_heads: int, eps: float) -> None:
        """Call only when `supported(...)` is true: the kernels trust these shapes and dtypes."""
        assert meta.decode is not None
        dec, t = meta.decode, x.shape[0]
        _, _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
        self.x, self._dtype, self._eps = x, x.dtype, eps
        self.h = torch.empty_like(x)
        self.attn_out = torch.empty(t, num_heads * head_dim, dtype=x.dtype)
        self._act: torch.Tensor | None = None
        self._bf16 = x.dtype == torch.bfloat16
        self._threads = torch.get_num_threads()
        self._profiling = torch.autograd.profiler._is_profiler_enabled
        self._cache = kv_cache.data_ptr()
        self._layer_bytes = kv_cache.stride(0) * kv_cache.element_size()
        self._qkv_width = (num_heads + 2 * kv_heads) * head_dim
        cos, sin = rope
        # decode_rope's arguments after (qkv, qkv_row_stride, layer cache)
        self._attn_tail = (
            dec.block_tables.data_ptr(), dec.block_tables.stride(0), dec.ctx_lens.data_ptr(),
            self.attn_out.data_ptr(), self.attn_out.stride(0), t, num_heads, kv_heads, head_dim,
            num_blocks, block_size, self._bf16, head_dim**-0.5, self._threads,
            positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr())

    def add_rms_norm(self, delta: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        """x += delta (when given); returns h = rmsnorm(x) * weight."""
        x, h = self.x, self.h
        d_ptr, d_stride = self._rows(delta, x.shape[1]) if delta is not None else (0, 0)
        self._call("fused_add_rms_norm", _fused.add_rms_norm,
                   (x.data_ptr(), x.stride(0), d_ptr, d_stride, weight.data_ptr(), h.data_ptr(),
                    h.stride(0), x.shape[0], x.shape[1], self._bf16, self._eps))
        return h

    def attend(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        """RoPE on qkv's q and k, k and v into layer `layer`'s slots, attention -> attn_out."""
        ptr, stride = self._rows(qkv, self._qkv_width)
        self._call("paged_attention_decode_rope", _paged_attn.decode_rope,
                   (ptr, stride, self._cache + layer * self._layer_bytes, *self._attn_tail))
        return self.attn_out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up's rows [gate | up]."""
        rows, n = gate_up.shape[0], gate_up.shape[1] // 2
        if rows * n > NATIVE_ACT_MAX_ELEMENTS:
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate, inplace=True).mul_(up)
        if self._act is None:
            self._act = torch.empty(rows, n, dtype=self._dtype)
        ptr, stride = self._rows(gate_up, 2 * n)
        self._call("fused_silu_mul", _fused.silu_mul,
                   (ptr, stride, self._act.data_ptr(), self._act.stride(0), rows, n, self._bf16))
        return self._act

    def _rows(self, t: torch.Tensor, width: int) -> tuple[int, int]:
        """(address, row stride) of a layer's output, checked: the kernels trust them."""
        rows = self.x.shape[0]
        if (t.dtype != self._dtype or t.device.type != "cpu" or t.stride(-1) != 1
                or t.shape != (rows, width)):
            raise ValueError(f"fused decode: expected [{rows}, {width}] {self._dtype} rows on CPU, "
                             f"got {tuple(t.shape)} {t.dtype} {t.device} strides {t.stride()}")
        return t.data_ptr(), t.stride(0)

    def _call(self, name: str, fn: Callable[..., None],
              args: tuple[int | float | bool, ...]) -> None:
        if self._profiling:  # not torch ops: name them for the profiler (bench/step_profile.py)
            with torch.profiler.record_function(name):
                fn(*args)
        else:
            fn(*args)
