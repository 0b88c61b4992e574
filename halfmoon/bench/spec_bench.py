"""`halfmoon bench engine --speculative ngram`: speculative decoding against the same engine with
speculation off, in the same run (the baseline), on three workloads:

    quoting   batch 1, the prompts of bench/data/quoting_prompts.jsonl (rewrite, extract,
              summarise-then-quote: answers that repeat their prompts), chat template, greedy,
              up to 128 tokens each: mean TPOT over the prompts           target: off / on >= 1.8
    open      batch 1, bench/data/open_prompts.jsonl (answers that do not repeat the prompt):
              mean TPOT                                                  target: off / on >= 0.97
    batch 32  the quoting prompts x 4 submitted at once: output tok/s    target: on / off >= 0.97
              (the policy turns speculation off above its measured crossover)

Greedy outputs must be token-identical on and off (checked; a mismatch fails the run). Both
engines share the weights, dtype, quantization and thread count; per workload they run back to
back (off first), each warmed up once. The speculating engine's acceptance, tokens per
verification and the crossover it measured from its own step times are printed with the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, NamedTuple

from halfmoon.core.params import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine

DATA = Path(__file__).parent / "data"
MAX_TOKENS = 128
BATCH_REPEAT = 4  # the batch workload: the quoting prompts x this (32 requests)
TARGETS = {"quoting_tpot": 1.8, "open_tpot": 0.97, "batch_tok_s": 0.97}


class Run(NamedTuple):
    tpot_ms: float  # mean over the requests of their mean TPOT
    tok_s: float  # output tokens / wall
    outputs: list[list[int]]


def load_prompts(name: str) -> list[str]:
    return [json.loads(line)["prompt"] for line in (DATA / name).read_text().splitlines() if line.strip()]


def chat_ids(engine: Engine, prompts: list[str]) -> list[list[int]]:
    tok = engine.tokenizer
    if tok.chat_template is None:
        return [tok.encode(p) for p in prompts]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]


def one_by_one(engine: Engine, prompts: list[list[int]]) -> Run:
    params = SamplingParams(max_tokens=MAX_TOKENS)
    tpots, outputs, tokens, wall = [], [], 0, 0.0
    for ids in prompts:
        start = time.perf_counter()
        result = engine.generate([ids], params)[0]
        wall += time.perf_counter() - start
        outputs.append(result.output_ids)
        tokens += len(result.output_ids)
        if len(result.output_ids) > 1:
            tpots.append(result.tpot_ms)
    return Run(statistics.fmean(tpots), tokens / wall, outputs)


def batched(engine: Engine, prompts: list[list[int]]) -> Run:
    start = time.perf_counter()
    results = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    wall = time.perf_counter() - start
    outputs = [r.output_ids for r in results]
    tpots = [r.tpot_ms for r in results if len(r.output_ids) > 1]
    return Run(statistics.fmean(tpots), sum(map(len, outputs)) / wall, outputs)


def measure(engines: dict[str, Engine], quoting: list[list[int]], open_ids: list[list[int]],
            log: Any) -> dict[str, dict[str, Run]]:
    out: dict[str, dict[str, Run]] = {}
    for name, run_fn, prompts in (("quoting", one_by_one, quoting), ("open", one_by_one, open_ids),
                                  ("batch", batched, quoting * BATCH_REPEAT)):
        out[name] = {}
        for mode, engine in engines.items():
            log(f"{name} on speculative={mode}")
            out[name][mode] = run_fn(engine, prompts)
    return out


def report(args: argparse.Namespace, runs: dict[str, dict[str, Run]], spec: Engine) -> dict[str, Any]:
    q, o, b = runs["quoting"], runs["open"], runs["batch"]
    ratios = {"quoting_tpot": q["off"].tpot_ms / q["ngram"].tpot_ms,
              "open_tpot": o["off"].tpot_ms / o["ngram"].tpot_ms,
              "batch_tok_s": b["ngram"].tok_s / b["off"].tok_s}
    pairs = [(a, b) for w in runs for a, b in zip(runs[w]["off"].outputs, runs[w]["ngram"].outputs)]
    identical = sum(a == b for a, b in pairs)
    stats = spec.speculator.stats
    return {
        "config": {"model": args.model, "dtype": args.dtype, "quantization": args.quantization[0],
                   "threads": args.threads, "max_tokens": MAX_TOKENS},
        "workloads": {w: {m: {"tpot_ms": round(r.tpot_ms, 2), "tok_s": round(r.tok_s, 1)} for m, r in v.items()}
                      for w, v in runs.items()},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "targets": TARGETS,
        "met": {k: ratios[k] >= TARGETS[k] for k in TARGETS},
        "greedy_identical": f"{identical}/{len(pairs)}",
        "greedy_all_identical": identical == len(pairs),
        "speculation": {"acceptance": round(stats.acceptance, 3), "tokens_per_verification": round(stats.tokens_per_step, 2),
                        "verifications": stats.steps, "skipped_batch_steps": stats.skipped_batch,
                        "measured_max_batch": spec.speculator.cost.max_batch()},
    }


def render(rep: dict[str, Any]) -> str:
    c, w, r, s = rep["config"], rep["workloads"], rep["ratios"], rep["speculation"]
    lines = [f"halfmoon bench engine --speculative ngram: {c['model']} {c['dtype']} "
             f"(quantization {c['quantization']}), {c['threads']} threads, up to {c['max_tokens']} tokens",
             f"{'workload':<10} {'off TPOT ms':>12} {'ngram TPOT ms':>14} {'off tok/s':>10} {'ngram tok/s':>12}"
             f" {'ratio':>7} {'target':>7}"]
    for name, key, metric in (("quoting", "quoting_tpot", "TPOT"), ("open", "open_tpot", "TPOT"),
                              ("batch 32", "batch_tok_s", "tok/s")):
        v = w["batch" if name == "batch 32" else name]
        mark = "ok" if rep["met"][key] else "MISSED"
        lines.append(f"{name:<10} {v['off']['tpot_ms']:>12.2f} {v['ngram']['tpot_ms']:>14.2f} {v['off']['tok_s']:>10.1f}"
                     f" {v['ngram']['tok_s']:>12.1f} {r[key]:>6.2f}x {'>=' + str(rep['targets'][key]):>7} {mark}"
                     f"  ({metric})")
    lines.append(f"greedy outputs identical on/off: {rep['greedy_identical']} requests; acceptance {s['acceptance']:.1%}, "
                 f"{s['tokens_per_verification']:.2f} tokens per verification, {s['verifications']} verifications, "
                 f"speculation off in {s['skipped_batch_steps']} steps (batch above {s['measured_max_batch']}, "
                 f"the crossover measured from this engine's step times)")
    return "\n".join(lines)


def main(args: argparse.Namespace, command: str) -> int:
    """`bench engine --speculative`: print the table (or JSON); 1 when fp32 greedy outputs differ."""
    from halfmoon.bench.engine_bench import FULL, engine_config, process_settings
    from halfmoon.bench.report import Progress

    with process_settings(args.threads):
        base = engine_config(args.dtype, FULL, args.threads, args.max_num_batched_tokens, args.quantization[0],
                             args.model)
        rep = run(args, base, Progress())
    rep["command"] = command
    print(json.dumps(rep, indent=2) if args.json else render(rep), flush=True)
    return 0 if rep["greedy_all_identical"] or args.dtype != "float32" else 1


def run(args: argparse.Namespace, base: EngineConfig, log: Any) -> dict[str, Any]:
    import dataclasses

    engines = {mode: Engine(dataclasses.replace(base, speculative=mode)) for mode in ("off", "ngram")}
    quoting = chat_ids(engines["off"], load_prompts("quoting_prompts.jsonl"))
    open_ids = chat_ids(engines["off"], load_prompts("open_prompts.jsonl"))
    if args.quick:
        quoting, open_ids = quoting[:2], open_ids[:2]
    for engine in engines.values():  # warm-up
        engine.generate(quoting[:1], SamplingParams(max_tokens=8))
    runs = measure(engines, quoting, open_ids, log)
    for engine in engines.values():
        engine.pool.check_integrity()
    return report(args, runs, engines["ngram"])
