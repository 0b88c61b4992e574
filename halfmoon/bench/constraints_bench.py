"""`halfmoon bench constraints`: what a JSON-schema constraint costs a decode step, against the
same engine decoding the same prompts unconstrained (the baseline, same run), and what the test
schemas cost to compile.

TPOT: for batch 1 and batch 32 (bench/data/open_prompts.jsonl, cycled), 64 tokens each,
`--rounds` rounds alternating unconstrained / constrained, each round's order flipped (ABBA), on
one engine; the median over rounds of the mean TPOT (wall / tokens after the first). The
constrained requests are held to schemas that cannot finish in 64 tokens (arrays of at least
20 of the test objects: keys, enums, bounded integers and strings all the way), so both runs
decode 64 tokens a request and the batch stays whole. Targets: <= 1.05x at batch 1, <= 1.10x at
batch 32. A constrained request that ends early (its tokens left the grammar: the engine aborts
it) fails the run.

Compile: each test schema, regex and choice compiled `--compiles` times by a fresh compiler
(the tokenizer's LLTokenizer built once, as in a server): p50 / p99 ms; and the per-token mask
time along a valid output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from halfmoon.core.params import Constraint, ConstraintKind, SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.engine.grammar import Grammars

DATA = Path(__file__).parent / "data"
NEW = 64
TARGETS = {1: 1.05, 32: 1.10}  # constrained / unconstrained TPOT, at most
ITEM_SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
               "properties": {"name": {"type": "string", "maxLength": 16},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120},
                              "role": {"enum": ["admin", "user", "guest"]}}},
    "item": {"type": "object", "additionalProperties": False, "required": ["sku", "qty", "express"],
             "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                            "express": {"type": "boolean"}}},
}
REGEX = r"\(\d{3}\) \d{3}-\d{4}"
CHOICE = ["positive", "negative", "neutral"]


def long_schema(item: dict[str, Any]) -> str:
    return json.dumps({"type": "array", "minItems": 20, "maxItems": 40, "items": item})


def prompts(engine: Engine, n: int) -> list[list[int]]:
    texts = [json.loads(line)["prompt"] for line in (DATA / "open_prompts.jsonl").read_text().splitlines() if line.strip()]
    return [engine.tokenizer.encode(texts[i % len(texts)]) for i in range(n)]


def run_once(engine: Engine, batch: list[list[int]], constrained: bool) -> tuple[float, list[list[int]]]:
    """Mean TPOT (ms) over the batch, and the outputs."""
    constraints = [Constraint(ConstraintKind.JSON_SCHEMA, long_schema(s)) for s in ITEM_SCHEMAS.values()]
    params = [SamplingParams(max_tokens=NEW, ignore_eos=True,
                             constraint=constraints[i % len(constraints)] if constrained else None)
              for i in range(len(batch))]
    results = engine.generate(batch, params)
    if constrained and any(len(r.output_ids) != NEW for r in results):
        raise RuntimeError("a constrained request ended before max_tokens: the comparison would be unfair")
    return statistics.fmean(r.tpot_ms for r in results), [r.output_ids for r in results]


def measure(engine: Engine, batch: list[list[int]], rounds: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {"plain": [], "constrained": []}
    for r in range(rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        for constrained in order:
            ms, _ = run_once(engine, batch, constrained)
            times["constrained" if constrained else "plain"].append(ms)
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"tpot_ms": medians, "ratio": medians["constrained"] / medians["plain"], "rounds_ms": times}


def compile_times(engine: Engine, repeats: int) -> dict[str, Any]:
    cases = [*(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(s)) for s in ITEM_SCHEMAS.values()),
             *(Constraint(ConstraintKind.JSON_SCHEMA, long_schema(s)) for s in ITEM_SCHEMAS.values()),
             Constraint(ConstraintKind.REGEX, REGEX), Constraint(ConstraintKind.CHOICE, json.dumps(CHOICE))]
    started = time.perf_counter()
    shared = Grammars(engine.tokenizer, engine.model_config.vocab_size, engine.stop_ids)
    shared.ll_tokenizer  # noqa: B018 - built once, as a server does
    tokenizer_ms = (time.perf_counter() - started) * 1e3
    samples = []
    for _ in range(repeats):
        for c in cases:
            fresh = Grammars(engine.tokenizer, engine.model_config.vocab_size, engine.stop_ids)
            fresh._ll = shared.ll_tokenizer  # the tokenizer is per server, the cache per constraint
            t = time.perf_counter()
            fresh.compile(c)
            samples.append((time.perf_counter() - t) * 1e3)
    samples.sort()
    return {"tokenizer_ms": round(tokenizer_ms, 1), "compiles": len(samples),
            "p50_ms": round(samples[len(samples) // 2], 3), "p99_ms": round(samples[int(len(samples) * 0.99)], 3),
            "mask_us": mask_times(engine, shared)}


def mask_times(engine: Engine, grammars: Grammars) -> dict[str, float]:
    """Per-token mask fill time along a valid output of the person schema."""
    text = json.dumps({"name": "Ada", "age": 36, "role": "admin"})
    ids = engine.tokenizer.encode(text, add_bos=False)
    state = grammars.state(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(ITEM_SCHEMAS["person"])), 0)
    bitmask = torch.full((1, (engine.model_config.vocab_size + 31) // 32), -1, dtype=torch.int32)
    took = []
    for i, token in enumerate(ids):
        t = time.perf_counter()
        state.fill_rows(bitmask, 0, ())
        took.append((time.perf_counter() - t) * 1e6)
        state.catch_up(ids[: i + 1])
    took.sort()
    return {"p50": round(took[len(took) // 2], 1), "max": round(took[-1], 1), "tokens": len(took)}


def render(rows: dict[int, dict[str, Any]], compiled: dict[str, Any]) -> str:
    lines = ["| batch | unconstrained TPOT ms | JSON-schema TPOT ms | ratio (target) |", "|---|---|---|---|"]
    for batch, r in rows.items():
        target = TARGETS.get(batch)
        verdict = "" if target is None else f" (<= {target}: {'met' if r['ratio'] <= target else 'MISSED'})"
        lines.append(f"| {batch} | {r['tpot_ms']['plain']:.2f} | {r['tpot_ms']['constrained']:.2f} | "
                     f"{r['ratio']:.3f}x{verdict} |")
    m = compiled["mask_us"]
    lines.append(f"\ncompile ({compiled['compiles']} of the test schemas, regex, choice; fresh cache): "
                 f"p50 {compiled['p50_ms']} ms, p99 {compiled['p99_ms']} ms; tokenizer once {compiled['tokenizer_ms']} ms; "
                 f"mask per token p50 {m['p50']} us, max {m['max']} us")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="halfmoon bench constraints", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--compiles", type=int, default=20, help="compiles of each test constraint")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    engine = Engine(EngineConfig(dtype=args.dtype, num_threads=args.threads, num_blocks=2048))
    run_once(engine, prompts(engine, 2), True)  # warm-up: the tokenizer, the schemas, the kernels
    started = time.perf_counter()
    rows = {b: measure(engine, prompts(engine, b), args.rounds) for b in (int(x) for x in args.batches.split(","))}
    compiled = compile_times(engine, args.compiles)
    engine.pool.check_integrity()
    out = {"bench": "constraints", "dtype": args.dtype, "threads": args.threads, "rounds": args.rounds,
           "seconds": round(time.perf_counter() - started, 1), "batches": rows, "compile": compiled}
    print(json.dumps(out, indent=1) if args.json else render(rows, compiled), flush=True)
    return 0 if all(r["ratio"] <= TARGETS.get(b, float("inf")) for b, r in rows.items()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
