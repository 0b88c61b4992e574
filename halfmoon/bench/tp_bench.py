"""`halfmoon bench engine --tp N`: a tensor-parallel engine's step time against TP=1, same run.

    halfmoon bench engine --tp 2 [--quick] [--json] [--threads T] [--repeats R]

Both engines (SmolLM2, fp32, the same config but `tp`) run the same work, back to back within a
repeat so both see the same machine weather:

    prefill   one PROMPT-token prompt: the wall time of its step
    decode    BATCH requests decoding together: ms per `engine.step()` over STEPS steps

and for the TP engine the time its rank 0 spent inside collectives (all_reduce, the logits'
gather; `TPGroup.seconds`) and their count, per step. Each rank gets `--threads` torch threads
(default: the cores divided among the ranks). No speed target: on a CPU the ranks share the
machine's cores and memory bandwidth; the figures say what the collectives cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from typing import Any, NamedTuple

from halfmoon.bench.report import machine_info, utc_now
from halfmoon.core.params import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine

MODEL = "smollm2"


class Sizes(NamedTuple):
    prompt: int
    batches: tuple[int, ...]
    steps: int


FULL = Sizes(prompt=256, batches=(1, 8), steps=32)
QUICK = Sizes(prompt=32, batches=(1, 4), steps=6)


class StepTimes(NamedTuple):
    step_ms: float
    collective_ms: float  # per step, rank 0's wait in collectives (0 for TP=1)
    collectives: float  # per step


def _group_totals(engine: Engine) -> tuple[float, int]:
    group = engine.model.group
    return (group.seconds, group.calls) if group is not None else (0.0, 0)


def time_steps(engine: Engine, prompts: list[list[int]], steps: int) -> StepTimes:
    """Prefill `prompts` (untimed), then time `steps` decode steps of the batch."""
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    while any(engine.scheduler.requests[i].num_output_tokens < 1 for i in ids if i in engine.scheduler.requests):
        engine.step()
    seconds, calls = _group_totals(engine)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    after, after_calls = _group_totals(engine)
    while engine.has_unfinished():
        engine.step()
    return StepTimes(wall / steps * 1e3, (after - seconds) / steps * 1e3, (after_calls - calls) / steps)


def time_prefill(engine: Engine, prompt: list[int]) -> StepTimes:
    seconds, calls = _group_totals(engine)
    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    wall = time.perf_counter() - start
    after, after_calls = _group_totals(engine)
    return StepTimes(wall * 1e3, (after - seconds) * 1e3, after_calls - calls)


def measure(engines: dict[int, Engine], sizes: Sizes, repeats: int) -> dict[str, dict[int, StepTimes]]:
    vocab = next(iter(engines.values())).model_config.vocab_size
    prompt = [100 + (7 * i) % (vocab - 200) for i in range(sizes.prompt)]
    runs: dict[str, dict[int, list[StepTimes]]] = {}
    for _ in range(repeats):
        for tp, engine in engines.items():  # back to back: the same machine weather
            runs.setdefault("prefill", {}).setdefault(tp, []).append(time_prefill(engine, prompt))
            for b in sizes.batches:
                batch = [[t + r for t in prompt] for r in range(b)]
                runs.setdefault(f"decode_b{b}", {}).setdefault(tp, []).append(time_steps(engine, batch, sizes.steps))
    return {work: {tp: StepTimes(*(statistics.median(v) for v in zip(*times))) for tp, times in by_tp.items()}
            for work, by_tp in runs.items()}


def report(args: argparse.Namespace, command: str, sizes: Sizes, results: dict[str, dict[int, StepTimes]]) -> dict[str, Any]:
    rows = {}
    for work, by_tp in results.items():
        one, many = by_tp[1], by_tp[args.tp]
        rows[work] = {"tp1_ms": round(one.step_ms, 2), f"tp{args.tp}_ms": round(many.step_ms, 2),
                      "ratio_tp1_over_tp": round(one.step_ms / many.step_ms, 3),
                      "collective_ms": round(many.collective_ms, 2), "collectives": round(many.collectives, 1)}
    return {"benchmark": "engine --tp", "command": command, "date": utc_now(),
            "machine": machine_info(args.threads), "model": MODEL, "dtype": "float32", "tp": args.tp,
            "threads_per_rank": args.threads, "quick": args.quick, "repeats": args.repeats,
            "sizes": sizes._asdict(), "results": rows}


def render(rep: dict[str, Any]) -> str:
    tp = rep["tp"]
    lines = [f"{rep['command']}  ({rep['date']}, {rep['threads_per_rank']} threads per rank)",
             f"{'work':<12}{'TP=1 ms':>10}{f'TP={tp} ms':>10}{'TP1/TP':>8}{'coll ms':>9}{'colls':>7}"]
    for work, r in rep["results"].items():
        lines.append(f"{work:<12}{r['tp1_ms']:>10.2f}{r[f'tp{tp}_ms']:>10.2f}{r['ratio_tp1_over_tp']:>8.2f}"
                     f"{r['collective_ms']:>9.2f}{r['collectives']:>7.0f}")
    lines.append("ms: prefill = the prompt's step; decode_bN = per step of N requests decoding. coll ms / colls: "
                 "rank 0's time in collectives and their count per step (TP>1 only)")
    return "\n".join(lines)


def main(args: argparse.Namespace, command: str) -> int:
    """Run TP=1 and TP=`args.tp` engines on the same work; print the table or JSON."""
    sizes = QUICK if args.quick else FULL
    threads = max(1, (os.cpu_count() or 1) // args.tp) if args.threads_default else args.threads
    args.threads = threads
    need = sizes.prompt + sizes.steps + 4
    base = EngineConfig(model=MODEL, num_blocks=max(sizes.batches) * (need // 16 + 2) + 8, num_threads=threads,
                        max_num_batched_tokens=max(sizes.prompt, 64), max_num_seqs=max(sizes.batches))
    engines = {1: Engine(base), args.tp: Engine(dataclasses.replace(base, tp=args.tp))}
    try:
        results = measure(engines, sizes, args.repeats)
    finally:
        for engine in engines.values():
            engine.close()
    rep = report(args, command, sizes, results)
    print(json.dumps(rep, indent=2) if args.json else render(rep), flush=True)
    return 0
