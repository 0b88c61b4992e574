"""The decoder of every supported family over the paged KV cache, readable top to bottom.

One layer definition with the families' switches (engine/model_config.py, engine/families.py):

    h = norm(x)                                   input_layernorm
    q, k, v = qkv(h) (+ bias: Qwen2)              one fused projection
    q, k = norm(q), norm(k)                       per head (qk_norm: Qwen3, Gemma 3)
    q, k = rope(q), rope(k)                       this layer's RoPE (Gemma 3 local layers: their own)
    a = attention(q, cache) (window: sliding layers see the last W tokens), scale per family
    x += norm(o(a)) or o(a)                       sandwich_norms: Gemma 3's post-attention norm
    x += norm(down(act(gate(h')) * up(h'))) ...   h' = norm(x); act silu or gelu_tanh

Weights are plain tensors (q/k/v and gate/up fused at load time so each layer does four
matmuls), or int8/int4 weight-only layers (`quantization`; int4 from a GGUF's own 4-bit blocks
when the loader gives them). Tensor-parallel (`shard` + `group`, engine/parallel.py): each rank
keeps its heads, MLP slice and vocabulary slice; `_reduce` sums o's and down's partial outputs,
the embedding is a masked lookup summed over the ranks, and rank 0 gathers the logits. `forward` takes one step's flat batch of tokens and returns logits
only for the rows that will be sampled. An all-decode step on CPU runs each layer's norms, RoPE,
KV write, attention and activation as native calls (`_decode_layer`, kernels/fused.py); other
steps, and any step without the extensions, run the torch ops of `_layer`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from halfmoon.engine import rope as rope_mod
from halfmoon.engine.families import family
from halfmoon.engine.model_config import ModelConfig
from halfmoon.engine.parallel import Shard, TPGroup, full_shard, take_q4
from halfmoon.kernels import fused
from halfmoon.kernels.attention import AttentionBackend, AttentionMetadata
from halfmoon.kernels.linear import DenseLayer, Linear
from halfmoon.kernels.quant_linear import Int4Linear, Int8Linear, Q4Groups, quantize_q4

if TYPE_CHECKING:
    from halfmoon.engine.lora_pool import LoraStep

# Called after layer l's K/V is written: the hook for layer-wise KV streaming (transport).
LayerHook = Callable[[int], None]
# The lm head's quantization per model quantization. A tied head is the embedding, which a Q4_1
# GGUF ships as Q8_0 (no 4-bit source), so int4 models keep an int8 head.
LM_HEAD = {"none": "none", "int8": "int8", "int4": "int8"}
RopeRows = tuple[torch.Tensor, torch.Tensor]  # cos, signed sin


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: DenseLayer  # [q + 2 kv, hidden]
    o: DenseLayer
    ffn_norm: torch.Tensor  # the norm before the MLP (HF Llama's post_attention_layernorm)
    gate_up: DenseLayer  # [2 * intermediate, hidden]
    down: DenseLayer
    window: int = 0  # sliding window (tokens); 0 = full attention
    local_rope: bool = False  # this layer uses the local (sliding) RoPE tables
    qkv_bias: torch.Tensor | None = None  # [q + 2 kv] (Qwen2)
    q_norm: torch.Tensor | None = None  # [head_dim] (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # sandwich norms (Gemma 3)
    post_ffn_norm: torch.Tensor | None = None

    def norms(self) -> list[torch.Tensor]:
        return [w for w in (self.input_norm, self.ffn_norm, self.q_norm, self.k_norm,
                            self.post_attn_norm, self.post_ffn_norm) if w is not None]


def rope_tables(cfg: ModelConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain RoPE tables of `cfg.rope_theta` over `cfg.max_position` (engine/rope.py has every kind)."""
    freq = rope_mod.inv_freq(rope_mod.RopeSpec(cfg.rope_theta), cfg.head_dim, cfg.max_position)
    return rope_mod.tables_from(freq, torch.arange(cfg.max_position), 1.0, dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm (normalise, then scale); torch's fused op, bit-identical in fp32."""
    return F.rms_norm(x, weight.shape, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF rotary embedding; x: [T, heads, head_dim]; cos/signed_sin: [T, 1, head_dim].

    Three kernels instead of six (14x faster at 2048 tokens than slice/neg/cat).
    """
    t, h, d = x.shape
    swapped = x.view(t, h, 2, d // 2).flip(2).view(t, h, d)
    return torch.addcmul(x * cos, swapped, signed_sin)


def gated_act(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up of rows [gate | up], in place in gate_up's first half."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh").mul_(up)
    return F.silu(gate, inplace=True).mul_(up)


class DecoderModel:
    """The decoder. Stateless between steps except for the KV cache passed in."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 backend: AttentionBackend, dtype: torch.dtype, quantization: str = "none",
                 q4: Mapping[str, Q4Groups] | None = None, max_positions: int | None = None,
                 wide: frozenset[str] = frozenset(), shard: Shard | None = None,
                 group: TPGroup | None = None) -> None:
        """`quantization`: none, int8 or int4 for every dense layer but the lm head, which is int8
        when quantized (see `LM_HEAD`); `q4`: the source's own 4-bit blocks by name, used as
        they are for int4 (other weights are quantized here); `max_positions`: the RoPE tables'
        length (the engine's max_model_len; default the model's); `wide`: weights the source
        stores with more than 4 bits, which int4 keeps as int8 (a layer fusing one is int8);
        `shard` / `group`: this rank's part of a tensor-parallel model and its collectives (both
        or neither)."""
        if (group is None) != (shard is None or shard.world == 1):
            raise ValueError("a tensor-parallel shard needs its group, and only it")
        self.cfg = cfg
        self.shard = shard or full_shard(cfg)
        self.group = group
        self.num_heads, self.num_kv_heads = self.shard.num_heads, self.shard.num_kv_heads
        self.backend = backend
        self.dtype = dtype
        self.quantization = quantization
        self._q4 = q4 or {}
        self._wide = wide
        self._norm_offset = family(cfg.architecture).norm_offset
        vocab = self.shard.vocab
        self.embed = _own(weights["model.embed_tokens.weight"][vocab], self.shard)
        # HF multiplies by the scale cast to the weights' dtype (Gemma3TextScaledWordEmbedding)
        self.embed_scale = torch.tensor(cfg.embed_scale).to(dtype) if cfg.embed_scale != 1.0 else None
        head, head_rows = (self.embed, slice(None)) if cfg.tie_word_embeddings else (weights["lm_head.weight"], vocab)
        self.lm_head = self._dense(LM_HEAD[quantization], [head], ["lm_head.weight"], [head_rows])
        self.final_norm = self._norm(weights["model.norm.weight"])
        self.layers = [self._build_layer(weights, i) for i in range(cfg.num_layers)]
        n = min(max_positions or cfg.max_position, cfg.max_position)
        self.global_rope = cfg.global_rope
        self.rope = rope_mod.rope_tables(self.global_rope, cfg, n, dtype)
        self.local_rope = rope_mod.rope_tables(cfg.local_rope, cfg, n, dtype) if cfg.local_rope_theta else self.rope
        # dynamic NTK: positions past the trained length need per-request frequencies (`rope_lens`)
        self.dynamic_from = self.global_rope.original_max_position if self.global_rope.dynamic else None
        norms = [self.final_norm, *(w for lw in self.layers for w in lw.norms())]
        # False: every step takes the torch path (the tests compare the two)
        self.fused_decode = fused.weights_supported(norms, dtype)

    @property
    def cos(self) -> torch.Tensor:  # the global RoPE tables (kept for the kernels' tests)
        return self.rope[0]

    @property
    def sin(self) -> torch.Tensor:
        return self.rope[1]

    def _norm(self, w: torch.Tensor) -> torch.Tensor:
        """A norm weight as applied: Gemma's (1 + w), computed in fp32 as HF does."""
        if not self._norm_offset:
            return w
        return (w.float() + self._norm_offset).to(w.dtype)

    def _dense(self, quantization: str, parts: list[torch.Tensor], names: list[str],
               rows: list[slice] | None = None, cols: slice | None = None) -> DenseLayer:
        """One layer of `parts` stacked along the output dimension (fused QKV / gate-up); a
        tensor-parallel rank keeps `rows` of each part (column-parallel) or the input columns
        `cols` (row-parallel), quantized as the whole weight is."""
        rows = rows or [slice(None)] * len(parts)
        if quantization == "int4" and any(n in self._wide for n in names):
            quantization = "int8"  # the source kept this layer wider than 4 bits: so do we
        if quantization == "int4":
            groups = [take_q4(self._q4[n] if n in self._q4 else quantize_q4(w), r, cols)
                      for w, n, r in zip(parts, names, rows)]
            return Int4Linear(groups[0] if len(groups) == 1 else Q4Groups.cat(groups))
        weight = parts[0][rows[0]] if len(parts) == 1 else torch.cat([w[r] for w, r in zip(parts, rows)], dim=0)
        if quantization == "int8":  # a row's scale is the whole row's, so quantize, then take columns
            layer = Int8Linear(weight)
            return layer if cols is None else layer.input_shard(cols)
        if quantization != "none":
            raise ValueError(f"unknown quantization {quantization!r} (none, int8, int4)")
        return Linear(_own(weight if cols is None else weight[:, cols], self.shard))

    def _build_layer(self, w: dict[str, torch.Tensor], i: int) -> LayerWeights:
        cfg, p, q = self.cfg, f"model.layers.{i}.", self.quantization
        qkv = [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
        gate_up = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        o, down = p + "self_attn.o_proj.weight", p + "mlp.down_proj.weight"
        ffn_norm = p + ("pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm")

        def optional(name: str, needed: bool) -> torch.Tensor | None:
            return self._norm(w[p + name]) if needed else None

        qkv_rows, ffn = list(self.shard.qkv_rows(cfg.head_dim)), self.shard.ffn
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([w[p + f"self_attn.{n}_proj.bias"][r] for n, r in zip("qkv", qkv_rows)])
        return LayerWeights(
            input_norm=self._norm(w[p + "input_layernorm.weight"]),
            qkv=self._dense(q, [w[n] for n in qkv], qkv, qkv_rows),
            o=self._dense(q, [w[o]], [o], cols=self.shard.o_cols(cfg.head_dim) if self.group else None),
            ffn_norm=self._norm(w[ffn_norm + ".weight"]),
            gate_up=self._dense(q, [w[n] for n in gate_up], gate_up, [ffn, ffn]),
            down=self._dense(q, [w[down]], [down], cols=ffn if self.group else None),
            window=cfg.window(i),
            local_rope=cfg.window(i) > 0 and cfg.local_rope_theta is not None,
            qkv_bias=bias,
            q_norm=optional("self_attn.q_norm.weight", cfg.qk_norm),
            k_norm=optional("self_attn.k_norm.weight", cfg.qk_norm),
            post_attn_norm=optional("post_attention_layernorm.weight", cfg.sandwich_norms),
            post_ffn_norm=optional("post_feedforward_layernorm.weight", cfg.sandwich_norms),
        )

    def weight_bytes_per_step(self) -> int:
        """Bytes of weights one decode step reads (every layer + final norm + lm head)."""
        total = self.final_norm.numel() * self.final_norm.element_size() + self.lm_head.nbytes()
        for lw in self.layers:
            total += sum(t.numel() * t.element_size() for t in lw.norms())
            if lw.qkv_bias is not None:
                total += lw.qkv_bias.numel() * lw.qkv_bias.element_size()
            total += lw.qkv.nbytes() + lw.o.nbytes() + lw.gate_up.nbytes() + lw.down.nbytes()
        return total

    @property
    def needs_rope_lens(self) -> bool:
        """Whether `forward` needs each token's sequence length (dynamic NTK RoPE)."""
        return self.dynamic_from is not None

    def _rope_rows(self, positions: torch.Tensor, rope_lens: torch.Tensor | None) -> tuple[RopeRows, RopeRows]:
        """Per-token (cos, signed sin) of the global and local RoPE, [T, head_dim] each."""
        local = (self.local_rope[0][positions], self.local_rope[1][positions])
        if self.dynamic_from is not None and rope_lens is not None and bool((rope_lens > self.dynamic_from).any()):
            rows = rope_mod.dynamic_rows(self.global_rope, self.cfg, positions, rope_lens, self.dtype)
            return rows, (local if self.local_rope is not self.rope else rows)
        glob = (self.rope[0][positions], self.rope[1][positions])
        return glob, (local if self.local_rope is not self.rope else glob)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, logits_rows: torch.Tensor,
                layer_hook: LayerHook | None = None, rope_lens: torch.Tensor | None = None,
                lora: LoraStep | None = None) -> torch.Tensor:
        """input_ids/positions: [T]; `rope_lens` [T]: the sequence length each token's RoPE is
        for (dynamic NTK only, engine/rope.py); `lora`: the rows' LoRA adapters
        (engine/lora_pool.py), added to each projection's output; returns logits
        [len(logits_rows), vocab] in fp32."""
        cfg = self.cfg
        x = self._embed(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        tables = self._step_tables(positions, rope_lens)
        if tables is not None and self.fused_decode and fused.supported(x, kv_cache, meta, self.num_heads, tables[0]):
            return self._forward_decode(x, tables, kv_cache, meta, logits_rows, layer_hook, lora)
        glob, local = self._rope_rows(positions, rope_lens)
        ropes = {False: tuple(t.unsqueeze(1) for t in glob), True: tuple(t.unsqueeze(1) for t in local)}
        attn_out = torch.empty(x.shape[0], self.num_heads * cfg.head_dim, dtype=x.dtype)
        for i, lw in enumerate(self.layers):
            x = self._layer(x, i, lw, kv_cache[i], ropes[lw.local_rope], meta, attn_out, lora)
            if layer_hook is not None:
                layer_hook(i)
        if logits_rows.numel() == 0:  # a step of mid-prompt chunks samples nothing
            return torch.empty(0, cfg.vocab_size)
        return self._logits(rms_norm(x[logits_rows], self.final_norm, cfg.rms_norm_eps))

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; tensor-parallel: each rank looks up the ids of its vocabulary slice
        (zeros for the others) and the ranks' rows are summed (exact: one of them is non-zero)."""
        if self.group is None:
            return F.embedding(input_ids, self.embed)
        vocab = self.shard.vocab
        outside = (input_ids < vocab.start) | (input_ids >= vocab.stop)
        x = F.embedding((input_ids - vocab.start).masked_fill_(outside, 0), self.embed)
        return self.group.all_reduce(x.masked_fill_(outside.unsqueeze(1), 0))

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's output summed over the ranks (as is without tensor parallelism)."""
        return partial if self.group is None else self.group.all_reduce(partial)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab]; tensor-parallel: gathered on rank 0, empty on the others."""
        logits = self.lm_head(h).float()
        if self.group is not None:
            whole = self.group.gather_logits(logits, self.cfg.vocab_size, self.shard.vocab_rows)
            if whole is None:
                return logits[:, :0]
            logits = whole
        cap = self.cfg.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _step_tables(self, positions: torch.Tensor,
                     rope_lens: torch.Tensor | None) -> tuple[tuple[RopeRows, RopeRows], torch.Tensor] | None:
        """The native decode's RoPE inputs: (global, local) tables and the rows to read in them
        (the positions, or, for dynamic NTK past the trained length, this step's own rows)."""
        if not self.fused_decode:
            return None
        if self.dynamic_from is not None and rope_lens is not None and bool((rope_lens > self.dynamic_from).any()):
            glob, local = self._rope_rows(positions, rope_lens)
            rows = torch.arange(positions.shape[0])
            return ((glob[0].contiguous(), glob[1].contiguous()),
                    (local[0].contiguous(), local[1].contiguous())), rows
        return (self.rope, self.local_rope), positions

    def _forward_decode(self, x: torch.Tensor, tables: tuple[tuple[RopeRows, RopeRows], torch.Tensor],
                        kv_cache: torch.Tensor, meta: AttentionMetadata, logits_rows: torch.Tensor,
                        layer_hook: LayerHook | None, lora: LoraStep | None) -> torch.Tensor:
        """`forward` for an all-decode step: each layer's MLP output is added to the residual by
        the next layer's first norm (the last one's by the final norm)."""
        (glob, local), rows = tables
        step = fused.DecodeStep(x, rows, glob, kv_cache, meta, self.num_heads,
                                self.cfg.rms_norm_eps, scale=self.cfg.attention_scale)
        delta = None
        for i, lw in enumerate(self.layers):
            delta = self._decode_layer(step, i, lw, delta, local if lw.local_rope else glob, lora)
            if layer_hook is not None:  # layer i's K/V are in the cache: decode_rope wrote them
                layer_hook(i)
        h = step.add_rms_norm(delta, self.final_norm)
        if logits_rows.numel() == 0:
            return torch.empty(0, self.cfg.vocab_size)
        return self._logits(h[logits_rows])

    def _decode_layer(self, step: fused.DecodeStep, i: int, lw: LayerWeights,
                      delta: torch.Tensor | None, rope: RopeRows, lora: LoraStep | None) -> torch.Tensor:
        """`_layer` in native calls; returns the MLP output, not yet added to the residual."""
        qkv = _project(lw.qkv, step.add_rms_norm(delta, lw.input_norm), lora, i, "qkv")
        if lw.qkv_bias is not None:
            qkv += lw.qkv_bias
        step.attend(i, qkv, rope=rope, window=lw.window, q_norm=lw.q_norm, k_norm=lw.k_norm)
        o = self._reduce(_project(lw.o, step.attn_out, lora, i, "o"))
        if lw.post_attn_norm is not None:
            o = step.rms_norm(o, lw.post_attn_norm)
        gate_up = _project(lw.gate_up, step.add_rms_norm(o, lw.ffn_norm), lora, i, "gate_up")
        mlp = self._reduce(_project(lw.down, step.act_mul(gate_up, self.cfg.activation), lora, i, "down"))
        return step.rms_norm(mlp, lw.post_ffn_norm) if lw.post_ffn_norm is not None else mlp

    def _layer(self, x: torch.Tensor, i: int, lw: LayerWeights, cache: torch.Tensor, rope: tuple[torch.Tensor, ...],
               meta: AttentionMetadata, attn_out: torch.Tensor, lora: LoraStep | None = None) -> torch.Tensor:
        """Decoder layer `i`; updates `x` (the residual stream, owned by forward) in place."""
        cfg = self.cfg
        t, heads, kv_heads, eps = x.shape[0], self.num_heads, self.num_kv_heads, cfg.rms_norm_eps
        qkv = _project(lw.qkv, rms_norm(x, lw.input_norm, eps), lora, i, "qkv")
        if lw.qkv_bias is not None:
            qkv += lw.qkv_bias
        qkv = qkv.view(t, heads + 2 * kv_heads, cfg.head_dim)
        qk = qkv[:, : heads + kv_heads]
        if lw.q_norm is not None and lw.k_norm is not None:
            qk = torch.cat((rms_norm(qk[:, :heads], lw.q_norm, eps), rms_norm(qk[:, heads:], lw.k_norm, eps)), dim=1)
        qk = apply_rope(qk, rope[0], rope[1])  # q and k rotated in one pass
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
        self.backend.write_kv(cache, k, v, meta.slot_mapping)
        self.backend.forward(q, cache, meta, attn_out, window=lw.window, scale=cfg.attention_scale)
        o = self._reduce(_project(lw.o, attn_out, lora, i, "o"))
        x += rms_norm(o, lw.post_attn_norm, eps) if lw.post_attn_norm is not None else o
        gate_up = _project(lw.gate_up, rms_norm(x, lw.ffn_norm, eps), lora, i, "gate_up")
        mlp = self._reduce(_project(lw.down, gated_act(gate_up, cfg.activation), lora, i, "down"))
        x += rms_norm(mlp, lw.post_ffn_norm, eps) if lw.post_ffn_norm is not None else mlp
        return x


def _project(layer: DenseLayer, x: torch.Tensor, lora: LoraStep | None, i: int, proj: str) -> torch.Tensor:
    """layer(x), plus the LoRA delta of each row's adapter when the step has any."""
    y = layer(x)
    return y if lora is None else lora.add(y, x, i, proj)


def _own(t: torch.Tensor, shard: Shard) -> torch.Tensor:
    """A tensor-parallel rank's slice in storage of its own, so the whole weight can be freed."""
    return t.clone() if shard.world > 1 else t
