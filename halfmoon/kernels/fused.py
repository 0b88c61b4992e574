"""A decode step's layer glue as a few native calls (kernels/_fused.c, kernels/_paged_attn.c).

At batch 1-32 a decoder layer's time outside its four matmuls is Python and torch dispatch, not
arithmetic: `engine/model.py`'s `_layer` issues ~20 torch calls (~55 ATen ops: F.rms_norm alone
is decomposed into ~20 in this torch). For an all-decode step on CPU the layer becomes

    h = add_rms_norm(x += delta)           _fused.add_rms_norm   (delta: the previous layer's MLP)
    qkv = qkv_proj(h)
    rope(q, k); cache[slot] = k, v; attend  _paged_attn.decode_rope -> attn_out
    h = add_rms_norm(x += o_proj(attn_out)) _fused.add_rms_norm
    delta = down(silu_mul(gate_up(h)))     _fused.silu_mul (a few rows; else F.silu + mul_)

and the model families' variations of it: a layer's own RoPE tables and sliding window, q / k
RMSNorm before RoPE (Qwen3, Gemma 3: `attend`'s rope, window, q_norm, k_norm, all inside
decode_rope), a softmax scale other than head_dim ** -0.5 (Gemma 3: the constructor's `scale`),
GELU-tanh instead of SiLU (`act_mul`) and plain norms of a branch's output before the residual
add (Gemma's post-attention / post-feedforward norms: `rms_norm`).

Numerics (tests/kernels/test_fused.py holds each call against the torch composition): RoPE and
the residual adds are bit-identical to torch in fp32 and bf16 (same products, same roundings);
the norms (q / k norm included) and SiLU use their own reduction order and e^x, so they differ
from torch by a few fp32 ulp (bf16: occasionally one bf16 ulp); GELU-tanh is computed as
x * sigmoid(2y), which does not cancel where torch's 0.5 x (1 + tanh y) does (gate < ~-2): there
the two differ by up to ~4e-7 absolute, ours the nearer to the exact value. The fused path runs in fp32 too: decode logits already
differ from transformers' by ~1e-4 (paged, batched attention), and tests/engine's greedy-token
and logit checks pass with it. Prefill and mixed steps keep the torch path, so a prefill's logits
stay bit-identical to transformers'.

A decoding request may bring several query rows (speculative decoding's verify step,
`DecodeBatch.q_lens`): the step is still all-decode, x has one row per query row, positions and
slot_mapping one entry per row, and decode_rope writes all of a request's new K/V before any of
its rows attends (kernels/attention.py).

Without the extensions (no C compiler at install) a loud warning at import, and every step takes
the torch path; so do CUDA tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from halfmoon.kernels.attention import AttentionMetadata

log = logging.getLogger(__name__)

try:
    from halfmoon.kernels import _fused, _paged_attn
except ImportError as e:  # built at install (setup.py); missing without a C compiler
    _fused = _paged_attn = None
    log.warning(
        "halfmoon.kernels._fused or kernels._paged_attn is not built (%s): every decode step runs ~3x "
        "the torch calls per layer (norms, RoPE, KV write, SiLU as separate ops; ~4-6 ms a step "
        "for SmolLM2 on a small CPU). Build them with `python setup.py build_ext --inplace`.", e)

AVAILABLE = _fused is not None and _paged_attn is not None
_DTYPES = (torch.float32, torch.bfloat16)
# the native attention's limits (kernels/_paged_attn.c)
MAX_HEAD_DIM, MAX_GROUP = 256, 16
# _fused.silu_mul beats F.silu + mul_ up to ~2 rows of 1536 (bf16: 5.2 vs 9.0 us a row on a
# 2-core AVX2 EPYC) and loses from ~4 (bf16) / ~8 (fp32) rows on: ATen's e^x loop is faster.
# gelu_tanh_mul: the same loop and the same threshold.
NATIVE_ACT_MAX_ELEMENTS = 4096
ACTIVATIONS = ("silu", "gelu_tanh")


def weights_supported(weights: list[torch.Tensor], dtype: torch.dtype) -> bool:
    """Whether the native calls can read these norm weights: contiguous CPU `dtype` (fp32 or
    bf16) vectors. Checked once per model; `supported` checks each step's tensors."""
    return AVAILABLE and dtype in _DTYPES and all(
        w.device.type == "cpu" and w.dtype == dtype and w.dim() == 1 and w.is_contiguous()
        for w in weights)


RopeTables = Sequence[torch.Tensor] | Sequence[tuple[torch.Tensor, torch.Tensor]]


def _flat_tables(rope: RopeTables) -> list[torch.Tensor]:
    """(cos, sin), (cos, sin, cos2, sin2, ...) or [(cos, sin), (cos2, sin2), ...] -> tensors."""
    return [t for entry in rope for t in ((entry,) if isinstance(entry, torch.Tensor) else entry)]


def supported(x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, num_heads: int,
              rope: RopeTables) -> bool:
    """Whether this step can run natively: an all-decode CPU step, fp32/bf16 throughout, the
    cache and every RoPE table the layers use contiguous [positions, head_dim] (`rope`: a
    (cos, sin) pair, or a sequence of tables or of pairs), int64 step inputs (the norm weights:
    `weights_supported`). A decode batch with several rows per request (`q_lens`) runs too: one
    x row per query row."""
    dec = meta.decode
    if not AVAILABLE or dec is None or dec.num_rows != meta.num_tokens or meta.prefills:
        return False
    if dec.q_starts is not None and (dec.q_starts.dtype != torch.int64
                                     or dec.q_starts.device.type != "cpu"
                                     or not dec.q_starts.is_contiguous()):
        return False
    head_dim, kv_heads = kv_cache.shape[-1], kv_cache.shape[-2]
    tables = _flat_tables(rope)
    tensors = (x, kv_cache, *tables)
    return (x.device.type == "cpu" and x.dtype in _DTYPES and x.is_contiguous()
            and all(t.dtype == x.dtype and t.device == x.device and t.is_contiguous()
                    for t in tensors)
            and all(t.dim() == 2 and t.shape[1] == head_dim for t in tables)
            and head_dim % 2 == 0 and head_dim <= MAX_HEAD_DIM
            and num_heads % kv_heads == 0 and num_heads // kv_heads <= MAX_GROUP
            and dec.block_tables.dtype == dec.ctx_lens.dtype == torch.int64
            and meta.slot_mapping.dtype == torch.int64
            and dec.block_tables.stride(1) == 1 and dec.ctx_lens.is_contiguous()
            and meta.slot_mapping.is_contiguous())


class DecodeStep:
    """One all-decode step's native calls. The addresses every layer shares (step inputs, RoPE
    tables, output buffers) are taken once here; each call then passes only what changes.

    `x` (the residual stream, [T, hidden]) is updated in place; `h`, `attn_out` and the results
    of `rms_norm` and the activations are this step's buffers, overwritten by each call that
    returns them.
    """

    __slots__ = ("x", "h", "attn_out", "_act", "_normed", "_dtype", "_bf16", "_eps", "_threads",
                 "_profiling", "_attn_head", "_positions", "_slots", "_rope", "_cache",
                 "_layer_bytes", "_qkv_width", "_head_dim", "_q_starts", "_keep")

    def __init__(self, x: torch.Tensor, positions: torch.Tensor,
                 rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                 meta: AttentionMetadata, num_heads: int, eps: float,
                 scale: float | None = None) -> None:
        """Call only when `supported(...)` is true: the kernels trust these shapes and dtypes.
        `positions`: one per row of x (a request's rows: its positions in order); `rope`: the default (cos, signed sin) tables; `scale`: the softmax scale of q . k
        (None = head_dim ** -0.5); `eps`: the norms' (q / k norm included)."""
        assert meta.decode is not None
        dec, t = meta.decode, x.shape[0]
        _, _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
        self.x, self._dtype, self._eps = x, x.dtype, eps
        self.h = torch.empty_like(x)
        self.attn_out = torch.empty(t, num_heads * head_dim, dtype=x.dtype)
        self._act: torch.Tensor | None = None
        self._normed: torch.Tensor | None = None
        self._bf16 = x.dtype == torch.bfloat16
        self._threads = torch.get_num_threads()
        self._profiling = torch.autograd.profiler._is_profiler_enabled
        self._cache = kv_cache.data_ptr()
        self._layer_bytes = kv_cache.stride(0) * kv_cache.element_size()
        self._qkv_width = (num_heads + 2 * kv_heads) * head_dim
        self._head_dim = head_dim
        cos, sin = rope
        # the tensors whose addresses the calls pass: alive as long as the step
        self._keep = (positions, cos, sin, kv_cache, meta)
        self._rope = (cos.data_ptr(), sin.data_ptr())
        self._positions, self._slots = positions.data_ptr(), meta.slot_mapping.data_ptr()
        # each request's query rows (0: one each); meta, kept above, holds the tensor
        self._q_starts = 0 if dec.q_starts is None else dec.q_starts.data_ptr()
        # decode_rope's arguments after (qkv, qkv_row_stride, layer cache) up to positions
        self._attn_head = (
            dec.block_tables.data_ptr(), dec.block_tables.stride(0), dec.ctx_lens.data_ptr(),
            self.attn_out.data_ptr(), self.attn_out.stride(0), dec.num, num_heads, kv_heads,
            head_dim, num_blocks, block_size, self._bf16,
            head_dim**-0.5 if scale is None else scale, self._threads)

    def add_rms_norm(self, delta: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        """x += delta (when given); returns h = rmsnorm(x) * weight."""
        x, h = self.x, self.h
        d_ptr, d_stride = self._rows(delta, x.shape[1]) if delta is not None else (0, 0)
        self._call("fused_add_rms_norm", _fused.add_rms_norm,
                   (x.data_ptr(), x.stride(0), d_ptr, d_stride, weight.data_ptr(), h.data_ptr(),
                    h.stride(0), x.shape[0], x.shape[1], self._bf16, self._eps))
        return h

    def rms_norm(self, t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """rmsnorm(t) * weight of rows t ([T, hidden], e.g. a branch's output before its residual
        add: Gemma's post-attention / post-feedforward norms), into a step buffer; t and x are
        left as they are."""
        ptr, stride = self._rows(t, self.x.shape[1])
        if self._normed is None:
            self._normed = torch.empty_like(self.x)
        out = self._normed
        # add_rms_norm without a delta only reads its x: here t
        self._call("fused_rms_norm", _fused.add_rms_norm,
                   (ptr, stride, 0, 0, weight.data_ptr(), out.data_ptr(), out.stride(0),
                    t.shape[0], t.shape[1], self._bf16, self._eps))
        return out

    def attend(self, layer: int, qkv: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor] | None = None, window: int = 0,
               q_norm: torch.Tensor | None = None,
               k_norm: torch.Tensor | None = None) -> torch.Tensor:
        """q / k RMSNorm (q_norm, k_norm: [head_dim] weights, when given), RoPE on qkv's q and k
        (`rope`: this layer's (cos, signed sin) tables, None = the constructor's), k and v into
        layer `layer`'s slots, attention over the last `window` tokens (0 = all) -> attn_out."""
        ptr, stride = self._rows(qkv, self._qkv_width)
        cos, sin = self._rope if rope is None else (self._table(rope[0]), self._table(rope[1]))
        self._call("paged_attention_decode_rope", _paged_attn.decode_rope,
                   (ptr, stride, self._cache + layer * self._layer_bytes, *self._attn_head,
                    self._positions, cos, sin, self._slots, window, self._norm_weight(q_norm),
                    self._norm_weight(k_norm), self._eps, self._q_starts))
        return self.attn_out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up's rows [gate | up]."""
        return self.act_mul(gate_up, "silu")

    def act_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """act(gate) * up of gate_up's rows [gate | up]; activation "silu" or "gelu_tanh"
        (torch's F.gelu(approximate="tanh")). Natively for a few rows, else torch's ops."""
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r} (choose from {ACTIVATIONS})")
        rows, n = gate_up.shape[0], gate_up.shape[1] // 2
        if rows * n > NATIVE_ACT_MAX_ELEMENTS:
            gate, up = gate_up.chunk(2, dim=-1)
            if activation == "silu":
                return F.silu(gate, inplace=True).mul_(up)
            return F.gelu(gate, approximate="tanh").mul_(up)
        if self._act is None:
            self._act = torch.empty(rows, n, dtype=self._dtype)
        ptr, stride = self._rows(gate_up, 2 * n)
        name, fn = (("fused_silu_mul", _fused.silu_mul) if activation == "silu"
                    else ("fused_gelu_tanh_mul", _fused.gelu_tanh_mul))
        self._call(name, fn,
                   (ptr, stride, self._act.data_ptr(), self._act.stride(0), rows, n, self._bf16))
        return self._act

    def _table(self, t: torch.Tensor) -> int:
        """A layer's RoPE table's address, checked (the kernel reads rows of head_dim)."""
        if (t.dtype != self._dtype or t.device.type != "cpu" or not t.is_contiguous()
                or t.dim() != 2 or t.shape[1] != self._head_dim):
            raise ValueError(f"fused decode: expected a contiguous [positions, {self._head_dim}] "
                             f"{self._dtype} RoPE table on CPU, got {tuple(t.shape)} {t.dtype} "
                             f"{t.device}")
        return t.data_ptr()

    def _norm_weight(self, w: torch.Tensor | None) -> int:
        """A q / k norm weight's address (0: none), checked: the kernel reads head_dim of it."""
        if w is None:
            return 0
        if (w.dtype != self._dtype or w.device.type != "cpu" or not w.is_contiguous()
                or w.shape != (self._head_dim,)):
            raise ValueError(f"fused decode: expected a contiguous [{self._head_dim}] "
                             f"{self._dtype} q / k norm weight on CPU, got {tuple(w.shape)} "
                             f"{w.dtype} {w.device}")
        return w.data_ptr()

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
