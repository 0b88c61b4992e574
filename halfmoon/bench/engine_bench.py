"""`halfmoon bench engine`: Halfmoon vs Hugging Face transformers, same token ids, one process.

    halfmoon bench engine [--model smollm2|gemma3-270m|PATH] [--json] [--dtype float32|bfloat16]
                          [--quantization none int8 int4] [--quick]
    python -m halfmoon.bench.engine_bench [same flags]

Workloads (full sizes; `--quick` scales them down for tests and CI, never for recorded figures):

    W1 single stream   1 x (256 prompt + 128 output), greedy, EOS ignored: TTFT, mean TPOT, tok/s
    W2 offline batch  32 x (256 prompt + 128 output) submitted at once:     output tok/s
    W3 long prefill    1 x (2048 prompt + 1 output):                        prefill tok/s
    roofline           weight bytes per decode step / Halfmoon's W1 TPOT, next to a copy
                       bandwidth measured in the same run with the same thread count
    quality            per quantized engine (or bf16): perplexity of engine/quality.py's fixed
                       text and greedy agreement on its fixed prompts, against fp32 unquantized

`--quantization` takes a list: one Halfmoon engine per entry (weight-only int8/int4 dense layers,
issue 23), all in `--dtype`, each against the same transformers run in `--dtype`.

Both systems get the same dtype, the same torch thread count and the same synthetic token ids
(seeded, in [100, vocab - 100), different per W2 request), and each is warmed up once. Within a
repeat the two systems run back to back per workload, so both see the same machine weather.

How each system is timed:
- Halfmoon: TTFT and mean TPOT come from `CompletionResult`; tok/s is output tokens over the wall
  time around `engine.generate` (prefill included). W2 is one `generate` call with 32 prompts.
- transformers: W1 timestamps every token inside the one timed `generate` call with a streamer
  that only reads the clock (`TokenClock`): TTFT = first token - call, TPOT = mean gap after it,
  tok/s = outputs / whole call. (Timing TTFT as a separate `generate(max_new_tokens=1)` and taking
  TPOT = (full - TTFT) / (outputs - 1) mixes two runs; on this shared CPU it gave negative TPOTs.)
  W2 is ONE batch through `generate` with an attention mask (all prompts have the same length, so
  the left-padded batch holds no padding). W3 is the wall time of `generate(max_new_tokens=1)`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import torch

from halfmoon.bench.report import Figure, Progress, machine_info, render_table, utc_now
from halfmoon.bench.step_profile import decode_step_profile, overhead_line
from halfmoon.engine.config import EngineConfig, torch_dtype
from halfmoon.engine import quality
from halfmoon.engine.config import QUANTIZATIONS
from halfmoon.engine.engine import Engine
from halfmoon.engine.loader import resolve_model_path
from halfmoon.engine.outputs import CompletionResult
from halfmoon.core.params import SamplingParams
from halfmoon.core.blocks import cdiv

MODEL = "smollm2"  # the default --model
BLOCK_SIZE = 16
MAX_NUM_SEQS = 32
MAX_NUM_BATCHED_TOKENS = 2048  # W3's 2048-token prompt runs as one prefill step, unchunked
BANDWIDTH_BYTES = 256 * 2**20
BASELINE = "transformers"
# Minimum Halfmoon/transformers ratios (issue 2): these put Halfmoon ahead of vLLM-CPU 0.32.
TARGETS = {
    "float32": {"w1_tok_s": 1.8, "w2_tok_s": 1.6, "w3_prefill_tok_s": 1.35},
    "bfloat16": {"w1_tok_s": 2.1, "w2_tok_s": 3.2, "w3_prefill_tok_s": 1.3},
}
# Weight-only quantized engines (issue 23): W1 ahead of llama.cpp's Q4_1 on this CPU.
QUANTIZED_TARGETS = {"w1_tok_s": 3.0}
# Quality bounds (issue 23): perplexity within this fraction of fp32's.
PERPLEXITY_BOUNDS = {"int8": 0.01, "int4": 0.03}
QUALITY_TOKENS = 32


def targets(dtype: str, quantization: str) -> dict[str, float]:
    return TARGETS[dtype] if quantization == "none" else QUANTIZED_TARGETS


def system_name(quantization: str) -> str:
    return "halfmoon" if quantization == "none" else f"halfmoon {quantization}"


class Sizes(NamedTuple):
    w1_prompt: int
    w1_output: int
    w2_batch: int
    w2_prompt: int
    w2_output: int
    w3_prompt: int


FULL = Sizes(w1_prompt=256, w1_output=128, w2_batch=32, w2_prompt=256, w2_output=128,
             w3_prompt=2048)
QUICK = Sizes(w1_prompt=64, w1_output=16, w2_batch=4, w2_prompt=64, w2_output=16, w3_prompt=256)


class Workload(NamedTuple):
    w1: list[int]
    w2: list[list[int]]
    w3: list[int]


class Stream(NamedTuple):
    """W1 for one system: latencies in ms, throughput in output tokens per second."""

    ttft_ms: float
    tpot_ms: float
    tok_s: float
    output_ids: list[int]


class Measured(NamedTuple):
    w1: Stream
    w2_tok_s: float
    w2_output_ids: list[list[int]]
    w3_ttft_ms: float


class System(Protocol):
    name: str

    def stream(self, prompt: list[int], n_out: int) -> Stream: ...
    def batch(self, prompts: list[list[int]], n_out: int) -> tuple[float, list[list[int]]]: ...
    def prefill_ms(self, prompt: list[int]) -> float: ...


def synthetic_ids(rows: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Deterministic ids in [100, vocab - 100): clear of the special tokens at either end."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (rows, length), generator=g).tolist()


def make_workload(sizes: Sizes, vocab: int) -> Workload:
    return Workload(w1=synthetic_ids(1, sizes.w1_prompt, vocab, seed=1)[0],
                    w2=synthetic_ids(sizes.w2_batch, sizes.w2_prompt, vocab, seed=2),
                    w3=synthetic_ids(1, sizes.w3_prompt, vocab, seed=3)[0])


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(wall seconds, result) of one call."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


# ---------------------------------------------------------------- the two systems


class HalfmoonSystem:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.name = system_name(engine.config.quantization)

    def _generate(self, prompts: list[list[int]],
                  n_out: int) -> tuple[float, list[CompletionResult]]:
        params = SamplingParams(max_tokens=n_out, ignore_eos=True)
        return timed(lambda: self.engine.generate(prompts, params))

    def stream(self, prompt: list[int], n_out: int) -> Stream:
        wall, (res,) = self._generate([prompt], n_out)
        return Stream(res.ttft_ms, res.tpot_ms, n_out / wall, res.output_ids)

    def batch(self, prompts: list[list[int]], n_out: int) -> tuple[float, list[list[int]]]:
        wall, results = self._generate(prompts, n_out)
        preempted = sum(r.num_preemptions for r in results)
        assert preempted == 0, f"{preempted} preemptions: the KV cache is sized too small"
        return len(prompts) * n_out / wall, [r.output_ids for r in results]

    def prefill_ms(self, prompt: list[int]) -> float:
        _, (res,) = self._generate([prompt], 1)
        return res.ttft_ms


class TokenClock:
    """A `generate` streamer that only reads the clock: put #0 is the prompt, put #k token k.

    `start` is taken when the clock is made, right before the `generate` call it is passed to.
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.puts: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(time.perf_counter())

    def end(self) -> None:
        pass  # nothing buffered

    def ttft_ms(self) -> float:
        return (self.puts[1] - self.start) * 1e3

    def tpot_ms(self) -> float:
        gaps = len(self.puts) - 2
        return (self.puts[-1] - self.puts[1]) / gaps * 1e3 if gaps > 0 else 0.0


class TransformersSystem:
    name = BASELINE

    def __init__(self, model: torch.nn.Module, pad_id: int) -> None:
        self.model, self.pad_id = model, pad_id
        self.device = next(model.parameters()).device  # the ids go where the model is (--device cuda)

    def _generate(self, prompts: list[list[int]], n_out: int,
                  clock: TokenClock | None = None) -> tuple[float, list[list[int]]]:
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        mask = torch.ones_like(ids)  # equal lengths: the left-padded batch has no padding
        with torch.inference_mode():
            wall, out = timed(lambda: self.model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n_out,
                min_new_tokens=n_out, use_cache=True, pad_token_id=self.pad_id, streamer=clock))
        new = out[:, ids.shape[1]:]
        assert new.shape[1] == n_out, f"transformers produced {new.shape[1]} tokens, not {n_out}"
        return wall, new.tolist()

    def stream(self, prompt: list[int], n_out: int) -> Stream:
        clock = TokenClock()
        wall, (out,) = self._generate([prompt], n_out, clock)
        return Stream(clock.ttft_ms(), clock.tpot_ms(), n_out / wall, out)

    def batch(self, prompts: list[list[int]], n_out: int) -> tuple[float, list[list[int]]]:
        wall, outs = self._generate(prompts, n_out)
        return len(prompts) * n_out / wall, outs

    def prefill_ms(self, prompt: list[int]) -> float:
        wall, _ = self._generate([prompt], 1)
        return wall * 1e3


@contextlib.contextmanager
def process_settings(threads: int) -> Iterator[None]:
    """Set torch threads and quiet transformers for the run; restore both afterwards, so an
    in-process caller (a test) keeps its own settings."""
    from transformers.utils import logging as hf_logging

    threads_before, verbosity, bars = (torch.get_num_threads(), hf_logging.get_verbosity(),
                                       hf_logging.is_progress_bar_enabled())
    torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        torch.set_num_threads(threads_before)
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def load_transformers(dtype: torch.dtype, model_name: str = MODEL) -> TransformersSystem:
    """transformers' model of the same file (a GGUF loaded by transformers' own GGUF path)."""
    from halfmoon.bench.hf_reference import hf_model

    model = hf_model(resolve_model_path(model_name), dtype)
    pad = model.generation_config.pad_token_id
    eos = model.generation_config.eos_token_id
    pad_id = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos)
    return TransformersSystem(model, int(pad_id))


def kv_blocks_needed(sizes: Sizes) -> int:
    """Blocks for the largest workload at once (W2), so nothing is ever preempted."""
    return max(sizes.w2_batch * cdiv(sizes.w2_prompt + sizes.w2_output, BLOCK_SIZE),
               cdiv(sizes.w1_prompt + sizes.w1_output, BLOCK_SIZE), cdiv(sizes.w3_prompt + 1, BLOCK_SIZE))


def engine_config(dtype: str, sizes: Sizes, threads: int, max_batched: int,
                  quantization: str = "none", model: str = MODEL) -> EngineConfig:
    return EngineConfig(model=model, dtype=dtype, quantization=quantization, block_size=BLOCK_SIZE,
                        num_blocks=kv_blocks_needed(sizes) + 16, max_num_seqs=MAX_NUM_SEQS,
                        max_num_batched_tokens=max_batched, num_threads=threads)


# ---------------------------------------------------------------- measuring


def warm_up(systems: list[System], vocab: int) -> None:
    """One short batched generate each, so first-call setup stays out of the timings."""
    prompts = synthetic_ids(2, 32, vocab, seed=0)
    for system in systems:
        system.batch(prompts, 4)


def measure_once(systems: list[System], work: Workload, sizes: Sizes,
                 progress: Progress) -> dict[str, Measured]:
    """One repeat: each workload on every system back to back."""
    w1, w2, w3 = {}, {}, {}
    for s in systems:
        progress(f"W1 single stream {sizes.w1_prompt}+{sizes.w1_output} on {s.name}")
        w1[s.name] = s.stream(work.w1, sizes.w1_output)
    for s in systems:
        progress(f"W2 batch {sizes.w2_batch}x({sizes.w2_prompt}+{sizes.w2_output}) on {s.name}")
        w2[s.name] = s.batch(work.w2, sizes.w2_output)
    for s in systems:
        progress(f"W3 prefill {sizes.w3_prompt} on {s.name}")
        w3[s.name] = s.prefill_ms(work.w3)
    return {s.name: Measured(w1[s.name], *w2[s.name], w3[s.name]) for s in systems}


def median_of(runs: list[Measured]) -> Measured:
    """Per-figure median over repeats; output ids from the last repeat (greedy: all equal)."""
    last = runs[-1]
    ttft, tpot, tok_s = (statistics.median(getattr(r.w1, f) for r in runs)
                         for f in ("ttft_ms", "tpot_ms", "tok_s"))
    stream = Stream(ttft, tpot, tok_s, last.w1.output_ids)
    return Measured(stream, statistics.median(r.w2_tok_s for r in runs), last.w2_output_ids,
                    statistics.median(r.w3_ttft_ms for r in runs))


def copy_bandwidth_gbps(nbytes: int = BANDWIDTH_BYTES, repeats: int = 5) -> float:
    """Best-of-`repeats` torch copy of an `nbytes` tensor: (bytes read + bytes written) / time."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    best = min(timed(lambda: dst.copy_(src))[0] for _ in range(repeats))
    return 2 * nbytes / best / 1e9


# ---------------------------------------------------------------- reporting


def figures(hm: Measured, hf: Measured, sizes: Sizes, t: dict[str, float]) -> list[Figure]:
    w3_hm, w3_hf = (sizes.w3_prompt / (m.w3_ttft_ms / 1e3) for m in (hm, hf))
    return [
        Figure("w1_ttft_ms", "W1 TTFT", "ms", hm.w1.ttft_ms, hf.w1.ttft_ms, False),
        Figure("w1_tpot_ms", "W1 mean TPOT", "ms", hm.w1.tpot_ms, hf.w1.tpot_ms, False),
        Figure("w1_tok_s", "W1 output", "tok/s", hm.w1.tok_s, hf.w1.tok_s, True, t.get("w1_tok_s")),
        Figure("w2_tok_s", "W2 output", "tok/s", hm.w2_tok_s, hf.w2_tok_s, True, t.get("w2_tok_s")),
        Figure("w3_prefill_tok_s", "W3 prefill", "tok/s", w3_hm, w3_hf, True,
               t.get("w3_prefill_tok_s")),
    ]


def roofline(weight_bytes: int, tpot_ms: float, bandwidth_gbps: float) -> dict[str, Any]:
    achieved = weight_bytes / (tpot_ms / 1e3) / 1e9
    return {"weight_bytes_per_step": weight_bytes, "decode_step_ms": round(tpot_ms, 3),
            "weights_gbps": round(achieved, 3), "copy_bandwidth_gbps": round(bandwidth_gbps, 3),
            "copy_bytes": BANDWIDTH_BYTES, "fraction": round(achieved / bandwidth_gbps, 4)}


def matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def checks(hm: Measured, hf: Measured) -> dict[str, int]:
    """Greedy outputs compared: a sanity check that both ran the same computation."""
    return {"w1_matching_prefix": matching_prefix(hm.w1.output_ids, hf.w1.output_ids),
            "w1_output_tokens": len(hm.w1.output_ids),
            "w2_identical_rows": sum(a == b for a, b in zip(hm.w2_output_ids, hf.w2_output_ids)),
            "w2_rows": len(hm.w2_output_ids)}


def measure_quality(engines: list[Engine], threads: int) -> dict[str, dict[str, Any]]:
    """Perplexity and greedy agreement of every engine that is not fp32 unquantized, against an
    fp32 unquantized engine (the run's own, else one loaded for this)."""
    todo = [e for e in engines if (e.config.dtype, e.config.quantization) != ("float32", "none")]
    if not todo:
        return {}
    ref = next((e for e in engines if e not in todo), None)
    ref = ref or Engine(EngineConfig(model=engines[0].config.model, num_blocks=64, num_threads=threads))
    text, prompts = ref.tokenizer.encode(quality.QUALITY_TEXT), quality.encode_prompts(ref)
    ppl_ref = quality.perplexity(ref, text)
    outputs_ref = quality.greedy_outputs(ref, prompts, QUALITY_TOKENS)
    out = {}
    for e in todo:
        ppl = quality.perplexity(e, text)
        agree = quality.agreement(quality.greedy_outputs(e, prompts, QUALITY_TOKENS), outputs_ref)
        bound = PERPLEXITY_BOUNDS.get(e.config.quantization)
        change = ppl / ppl_ref - 1
        out[system_name(e.config.quantization)] = {
            "perplexity": round(ppl, 4), "fp32_perplexity": round(ppl_ref, 4),
            "perplexity_change": round(change, 5), "bound": bound,
            "met": None if bound is None else abs(change) < bound, "text_tokens": len(text),
            "greedy_identical": agree.identical, "greedy_prompts": agree.prompts,
            "greedy_token_fraction": round(agree.token_fraction, 4), "greedy_tokens": QUALITY_TOKENS}
    return out


def render_system(name: str, sec: dict[str, Any], dtype: str) -> list[str]:
    r, k, q = sec["roofline"], sec["checks"], sec.get("quality")
    lines = [f"== {name} ({dtype}, quantization {sec['quantization']}) vs {BASELINE} ({dtype})",
             render_table(sec["figs"], BASELINE), "",
             f"roofline: {r['weight_bytes_per_step'] / 1e6:.1f} MB weights / "
             f"{r['decode_step_ms']:.2f} ms decode step = {r['weights_gbps']:.2f} GB/s; copy bandwidth "
             f"{r['copy_bandwidth_gbps']:.2f} GB/s -> {r['fraction']:.1%} of the limit",
             f"check: W1 greedy outputs agree on the first {k['w1_matching_prefix']}/"
             f"{k['w1_output_tokens']} tokens; W2 {k['w2_identical_rows']}/{k['w2_rows']} rows identical"]
    if q:
        bound = "" if q["bound"] is None else (f" (bound {q['bound']:.0%}: " + ("met" if q["met"] else "MISSED") + ")")
        lines.append(f"quality vs fp32: perplexity {q['perplexity']:.3f} vs {q['fp32_perplexity']:.3f} "
                     f"({q['perplexity_change']:+.2%}){bound} on {q['text_tokens']} tokens; greedy "
                     f"{q['greedy_identical']}/{q['greedy_prompts']} prompts identical, "
                     f"{q['greedy_token_fraction']:.0%} of {q['greedy_tokens']}-token continuations")
    lines.append("where a batch-1 decode step goes (ms, torch profiler): " + ", ".join(
        f"{key} {v:.2f}" for key, v in sec["decode_step_profile_ms"].items()))
    lines.append(overhead_line(sec["decode_step_profile_ms"]))
    return [*lines, ""]


def render_text(report: dict[str, Any], sections: dict[str, dict[str, Any]]) -> str:
    m, c = report["machine"], report["config"]
    w = report["workloads"]
    lines = [
        f"halfmoon bench engine: {c['model']} {c['dtype']} (quantization {', '.join(c['quantization'])}), "
        f"{m['threads']} threads, {m['cpu']} ({m['cores']} cores), torch {m['torch']}, "
        f"transformers {m['transformers']}",
        f"{report['date']}  $ {report['command']}",
        f"W1 1x({w['w1']['prompt_tokens']}+{w['w1']['output_tokens']})  "
        f"W2 {w['w2']['requests']}x({w['w2']['prompt_tokens']}+{w['w2']['output_tokens']})  "
        f"W3 1x({w['w3']['prompt_tokens']}+1)  repeats {c['repeats']} (median)  "
        f"max_num_batched_tokens {c['max_num_batched_tokens']}  kv {c['num_blocks']} blocks"
        + ("  [--quick: not for recording]" if c["quick"] else ""),
        "",
    ]
    for name, sec in sections.items():
        lines += render_system(name, sec, c["dtype"])
    lines.append(f"targets: {'all met' if report['targets_met'] else 'some MISSED'} (reported, never asserted)")
    return "\n".join(lines)


# ---------------------------------------------------------------- entry point


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="halfmoon bench engine",
                                description="Halfmoon vs transformers on the same token ids")
    p.add_argument("--model", default=MODEL,
                   help=f"alias (smollm2, gemma3-270m) or GGUF file / HF folder; transformers loads "
                        f"the same (default: {MODEL})")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of the table")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--quantization", nargs="+", choices=QUANTIZATIONS, default=["none"],
                   help="one Halfmoon engine per entry (weight-only dense layers), each against "
                        "the same transformers run (default: none)")
    p.add_argument("--quick", action="store_true",
                   help="scaled-down sizes for tests/CI; never for recorded figures")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads for both systems (default: all cores)")
    p.add_argument("--repeats", type=int, default=1, help="timed repeats; figures are medians")
    p.add_argument("--max-num-batched-tokens", type=int, default=MAX_NUM_BATCHED_TOKENS,
                   help="Halfmoon's per-step token budget")
    p.add_argument("--speculative", choices=["ngram"], default=None,
                   help="instead: speculative decoding against the same engine with it off "
                        "(quoting / open / batch-32 workloads, bench/spec_bench.py)")
    p.add_argument("--tp", type=int, default=1, help="> 1: a tensor-parallel engine's step and collective "
                   "time against TP=1 in the same run (bench/tp_bench.py) instead of the transformers comparison")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: graphs on / off against "
                   "transformers on the same GPU (bench/cuda_bench.py; --attention-backend)")
    p.add_argument("--attention-backend", choices=["torch", "flashinfer"], default="torch")
    args = p.parse_args(argv)
    args.threads_default = "--threads" not in argv
    if args.threads <= 0 or args.repeats <= 0 or args.max_num_batched_tokens <= 0 or args.tp <= 0:
        p.error("--threads, --repeats, --max-num-batched-tokens and --tp must be > 0")
    if len(set(args.quantization)) != len(args.quantization):
        p.error("--quantization lists a value twice")
    return args


class Results(NamedTuple):
    """Everything one run measured, before it is turned into a report; per-engine dicts are
    keyed by system name (`halfmoon`, `halfmoon int8`, ...), in --quantization order."""

    halfmoon: dict[str, Measured]
    transformers: Measured
    quantization: dict[str, str]
    weight_bytes_per_step: dict[str, int]
    copy_bandwidth_gbps: float
    decode_profile: dict[str, dict[str, float]]
    quality: dict[str, dict[str, Any]]


def run(args: argparse.Namespace, sizes: Sizes, configs: list[EngineConfig],
        progress: Progress) -> Results:
    """Load every system, warm them up, time every workload `repeats` times, then profile each
    engine's decode step, measure quality and the copy bandwidth."""
    engines = []
    for config in configs:
        progress(f"loading Halfmoon ({args.model}, {args.dtype}, quantization {config.quantization})")
        engines.append(Engine(config))
    progress(f"loading transformers ({args.model}, {args.dtype})")
    systems: list[System] = [*(HalfmoonSystem(e) for e in engines),
                             load_transformers(torch_dtype(args.dtype), args.model)]
    vocab = engines[0].model_config.vocab_size
    work = make_workload(sizes, vocab)
    progress("warming up every system")
    warm_up(systems, vocab)
    runs: list[dict[str, Measured]] = []
    for i in range(args.repeats):
        progress(f"repeat {i + 1}/{args.repeats}")
        runs.append(measure_once(systems, work, sizes, progress))
    medians = {s.name: median_of([r[s.name] for r in runs]) for s in systems}
    names = [system_name(e.config.quantization) for e in engines]
    profiles = {}
    for name, engine in zip(names, engines):
        progress(f"profiling {name} decode steps (batch 1)")
        profiles[name] = decode_step_profile(engine, work.w1)
    progress("quality: perplexity and greedy agreement against fp32")
    qual = measure_quality(engines, args.threads)
    progress(f"measuring copy bandwidth ({BANDWIDTH_BYTES // 2**20} MB, {args.threads} threads)")
    return Results({n: medians[n] for n in names}, medians[BASELINE],
                   {n: e.config.quantization for n, e in zip(names, engines)},
                   {n: e.model.weight_bytes_per_step() for n, e in zip(names, engines)},
                   copy_bandwidth_gbps(), profiles, qual)


METHOD = {
    "halfmoon_w1": "TTFT and TPOT from CompletionResult",
    "transformers_w1": "a clock-only streamer timestamps each token of the timed generate: "
                       "TTFT = first token - call, TPOT = mean gap after the first token",
    "tok_s": "output tokens / wall time of the whole generate, prefill included",
    "w3": "prompt tokens / TTFT; transformers' TTFT = wall time of generate(max_new_tokens=1)",
    "quality": "engine/quality.py: perplexity of QUALITY_TEXT (one prefill, logits at every "
               "position) and greedy continuations of QUALITY_PROMPTS, against fp32 unquantized",
}


def section(res: Results, name: str, sizes: Sizes, dtype: str) -> dict[str, Any]:
    """One Halfmoon engine's figures against transformers (`figs` is dropped from the JSON)."""
    hm, q = res.halfmoon[name], res.quantization[name]
    figs = figures(hm, res.transformers, sizes, targets(dtype, q))
    sec = {"quantization": q, "figs": figs, "figures": {f.key: f.to_json(BASELINE) for f in figs},
           "roofline": roofline(res.weight_bytes_per_step[name], hm.w1.tpot_ms, res.copy_bandwidth_gbps),
           "checks": checks(hm, res.transformers), "decode_step_profile_ms": res.decode_profile[name]}
    if name in res.quality:
        sec["quality"] = res.quality[name]
    return sec


def targets_met(sec: dict[str, Any]) -> bool:
    quality_met = sec.get("quality", {}).get("met")
    return all(f.met is not False for f in sec["figs"]) and quality_met is not False


def build_report(args: argparse.Namespace, command: str, sizes: Sizes, config: EngineConfig,
                 res: Results) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The JSON report (the first engine's figures at the top level, as before --quantization
    took a list; every engine's under `systems`) and the sections for the text."""
    sections = {name: section(res, name, sizes, args.dtype) for name in res.halfmoon}
    first = next(iter(sections.values()))
    report = {
        "benchmark": "engine", "command": command, "date": utc_now(),
        "machine": machine_info(args.threads),
        "config": {"model": args.model, "model_path": str(resolve_model_path(args.model)),
                   "dtype": args.dtype, "quantization": list(args.quantization), "quick": args.quick,
                   "repeats": args.repeats, "block_size": config.block_size,
                   "num_blocks": config.num_blocks, "max_num_seqs": config.max_num_seqs,
                   "max_num_batched_tokens": config.max_num_batched_tokens},
        "workloads": workloads_json(sizes),
        **{k: v for k, v in first.items() if k not in ("figs", "quantization")},
        "systems": {n: {k: v for k, v in s.items() if k != "figs"} for n, s in sections.items()},
        "targets_met": all(targets_met(s) for s in sections.values()),
        "method": METHOD,
    }
    return report, sections


def workloads_json(sizes: Sizes) -> dict[str, dict[str, int]]:
    rows = {"w1": (1, sizes.w1_prompt, sizes.w1_output), "w2": (sizes.w2_batch, sizes.w2_prompt, sizes.w2_output),
            "w3": (1, sizes.w3_prompt, 1)}
    return {k: dict(zip(("requests", "prompt_tokens", "output_tokens"), v)) for k, v in rows.items()}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table (or, with --json, one JSON object); returns 0."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    command = shlex.join(["halfmoon", "bench", "engine", *argv])
    if args.tp > 1:
        from halfmoon.bench import tp_bench

        return tp_bench.main(args, command)
    if args.speculative:
        from halfmoon.bench import spec_bench

        return spec_bench.main(args, command)
    if args.device == "cuda":
        from halfmoon.bench import cuda_bench

        return cuda_bench.main(args, command)
    sizes = QUICK if args.quick else FULL
    configs = [engine_config(args.dtype, sizes, args.threads, args.max_num_batched_tokens, q, args.model)
               for q in args.quantization]
    with process_settings(args.threads):
        results = run(args, sizes, configs, Progress())
    report, sections = build_report(args, command, sizes, configs[0], results)
    print(json.dumps(report, indent=2) if args.json else render_text(report, sections), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
