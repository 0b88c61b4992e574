"""`halfmoon bench sampling`: what logprobs and logit processing cost a decode step, against the
same engine decoding the same requests without them (the baseline, same run).

For batch 1 and batch 32 (the prompts of bench/data/open_prompts.jsonl, cycled), greedy, 64
tokens each, `--rounds` rounds alternating plain / asking, each round's order flipped (ABBA), on
one engine: the median over rounds of the step-mean TPOT (decode-only steps: wall / tokens after
the first). Variants: `top_logprobs=5` (target: <= 1.05x plain at batch 1 and 32) and
`penalties` (frequency + presence + repetition + a logit_bias entry; reported, no target).
Every variant's greedy tokens are checked equal to plain's where they must be (logprobs change
nothing sampled); a mismatch fails the run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from halfmoon.core.params import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine

DATA = Path(__file__).parent / "data"
NEW = 64
TARGET = 1.05  # logprobs / plain TPOT, at most
VARIANTS = {
    "plain": {},
    "top_logprobs=5": {"logprobs": 5},
    "penalties": {"frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.1,
                  "logit_bias": {28: -5.0}},
}


def prompts(engine: Engine, n: int) -> list[list[int]]:
    texts = [json.loads(line)["prompt"] for line in (DATA / "open_prompts.jsonl").read_text().splitlines() if line.strip()]
    return [engine.tokenizer.encode(texts[i % len(texts)]) for i in range(n)]


def tpot_ms(engine: Engine, batch: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Mean ms per output token after the first (wall over the batch's decode), and the outputs."""
    results = engine.generate(batch, params)
    return statistics.fmean(r.tpot_ms for r in results), [r.output_ids for r in results]


def measure(engine: Engine, batch: list[list[int]], rounds: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            params = SamplingParams(max_tokens=NEW, ignore_eos=True, **VARIANTS[name])
            ms, out = tpot_ms(engine, batch, params)
            times[name].append(ms)
            outputs.setdefault(name, out)
    medians = {name: statistics.median(v) for name, v in times.items()}
    return {"tpot_ms": medians, "ratio": {n: medians[n] / medians["plain"] for n in VARIANTS if n != "plain"},
            "logprobs_tokens_identical": outputs["top_logprobs=5"] == outputs["plain"]}


def render(rows: dict[int, dict[str, Any]]) -> str:
    lines = ["| batch | plain TPOT ms | top_logprobs=5 ms (x plain, target <= 1.05) | penalties ms (x plain) |",
             "|---|---|---|---|"]
    for batch, r in rows.items():
        t, x = r["tpot_ms"], r["ratio"]
        verdict = "met" if x["top_logprobs=5"] <= TARGET else "MISSED"
        lines.append(f"| {batch} | {t['plain']:.2f} | {t['top_logprobs=5']:.2f} ({x['top_logprobs=5']:.3f}x, {verdict}) "
                     f"| {t['penalties']:.2f} ({x['penalties']:.3f}x) |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="halfmoon bench sampling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    engine = Engine(EngineConfig(dtype=args.dtype, num_threads=args.threads, num_blocks=2048))
    engine.generate(prompts(engine, 2), SamplingParams(max_tokens=8, logprobs=5, frequency_penalty=0.1))  # warm-up
    started = time.perf_counter()
    rows = {b: measure(engine, prompts(engine, b), args.rounds) for b in (int(x) for x in args.batches.split(","))}
    engine.pool.check_integrity()
    out = {"bench": "sampling", "dtype": args.dtype, "threads": args.threads, "rounds": args.rounds,
           "seconds": round(time.perf_counter() - started, 1), "batches": rows}
    print(json.dumps(out, indent=1) if args.json else render(rows), flush=True)
    identical = all(r["logprobs_tokens_identical"] for r in rows.values())
    met = all(r["ratio"]["top_logprobs=5"] <= TARGET for r in rows.values())
    if not identical:
        print("logprobs changed the sampled tokens: a bug", flush=True)
    return 0 if identical and met else 1


if __name__ == "__main__":
    raise SystemExit(main())
