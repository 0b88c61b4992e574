"""`halfmoon bench choices`: n > 1 on a 1P1D pair, and what prompt logprobs cost a prefill.

1. **n = 8 vs n = 1** (target: n = 8 ends within 1.5x n = 1's time). One prefill worker and one
   decode worker in this process (no Ray, no Conductor: what the Conductor calls, as the pair
   tests do), KV over loopback TCP. A 512-token prompt, 64 tokens each, sampled (temperature
   0.8, seeded), `--rounds` rounds alternating n = 1 / n = 8 (ABBA), a fresh `cache_salt` per
   request so nothing is a prefix-cache hit. Per request: wall time from `reserve` to the last
   chunk, the KV bytes the decode worker received and the prompt tokens the prefill worker
   computed: both must equal n = 1's (the prompt is computed and sent once), else the run fails.
2. **prompt-logprob prefill** (target: <= 1.15x a plain prefill). One engine, the same 512-token
   prompt, `max_tokens=1`, `prompt_logprobs=5` vs none, ABBA, fresh salts: the median prefill
   time (`prefill_ms`: admitted -> first token, on an idle engine).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from halfmoon.conductor.cluster_config import ClusterConfig
from halfmoon.core.messages import DecodeTask, PrefillTask, TokenChunk
from halfmoon.core.params import SamplingParams
from halfmoon.decode_worker.worker import DecodeWorker
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.prefill_worker.worker import PrefillWorker
from halfmoon.transport.config import TransportConfig

DATA = Path(__file__).parent / "data"
PROMPT_TOKENS = 512
NEW = 64
CHOICES = 8
N_TARGET = 1.5  # n = 8 time / n = 1 time, at most
PROMPT_TARGET = 1.15  # prompt-logprob prefill / plain prefill, at most
TIMEOUT_S = 300.0


def long_prompt(tokenizer: Any) -> list[int]:
    texts = [json.loads(line)["prompt"] for line in (DATA / "open_prompts.jsonl").read_text().splitlines() if line.strip()]
    ids: list[int] = []
    i = 0
    while len(ids) < PROMPT_TOKENS:
        ids += tokenizer.encode(texts[i % len(texts)] + "\n")
        i += 1
    return ids[:PROMPT_TOKENS]


async def one_request(prefill: PrefillWorker, decode: DecodeWorker, prompt: list[int],
                      params: SamplingParams) -> dict[str, float]:
    """Reserve, prefill and decode one request as the Conductor does; its wall time and counts."""
    rid, salt = f"bench-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    received = (await decode.load()).kv_bytes_received
    computed = prefill.engine.scheduler.stats.prompt_tokens_computed
    start = time.perf_counter()
    handoff = await decode.reserve(rid, len(prompt), params.max_tokens, TIMEOUT_S)
    prefilled = asyncio.ensure_future(prefill.prefill(PrefillTask(rid, prompt, params, salt, handoff, TIMEOUT_S)))
    chunks: list[TokenChunk] = [c async for c in decode.generate(DecodeTask(rid, prompt, params, salt, TIMEOUT_S))]
    seconds = time.perf_counter() - start
    await prefilled
    assert chunks[-1].end is not None
    return {"seconds": seconds, "kv_bytes": (await decode.load()).kv_bytes_received - received,
            "prompt_tokens_computed": prefill.engine.scheduler.stats.prompt_tokens_computed - computed,
            "completion_tokens": chunks[-1].end.usage.completion_tokens}


def choices_part(engine: EngineConfig, rounds: int) -> dict[str, Any]:
    config = ClusterConfig(engine=engine, transport=TransportConfig(backend="tcp", host="127.0.0.1"))
    specs = [dataclasses.replace(s, cpus=None) for s in config.specs(None)]
    prefill = PrefillWorker(next(s for s in specs if s.role == "prefill"))
    decode = DecodeWorker(next(s for s in specs if s.role == "decode"))
    try:
        prompt = long_prompt(prefill.engine.tokenizer)
        runs: dict[int, list[dict[str, float]]] = {1: [], CHOICES: []}
        asyncio.run(one_request(prefill, decode, prompt, SamplingParams(max_tokens=4)))  # warm-up
        for r in range(rounds):
            for n in ((1, CHOICES) if r % 2 == 0 else (CHOICES, 1)):
                params = SamplingParams(max_tokens=NEW, temperature=0.8, seed=r, ignore_eos=True, n=n)
                runs[n].append(asyncio.run(one_request(prefill, decode, prompt, params)))
    finally:
        prefill.close()
        decode.close()
    return summarise(runs)


def summarise(runs: dict[int, list[dict[str, float]]]) -> dict[str, Any]:
    med = {n: statistics.median(r["seconds"] for r in rs) for n, rs in runs.items()}
    once = all(r["kv_bytes"] == runs[1][0]["kv_bytes"] and r["prompt_tokens_computed"] == PROMPT_TOKENS
               for rs in runs.values() for r in rs)
    return {"seconds": med, "ratio": med[CHOICES] / med[1], "kv_bytes": {n: rs[0]["kv_bytes"] for n, rs in runs.items()},
            "prompt_tokens_computed": {n: rs[0]["prompt_tokens_computed"] for n, rs in runs.items()},
            "completion_tokens": {n: rs[0]["completion_tokens"] for n, rs in runs.items()}, "computed_once": once}


def prompt_logprobs_part(engine_config: EngineConfig, rounds: int) -> dict[str, Any]:
    engine = Engine(engine_config)
    try:
        prompt = long_prompt(engine.tokenizer)
        variants = {"plain": SamplingParams(max_tokens=1), "prompt_logprobs=5": SamplingParams(max_tokens=1, prompt_logprobs=5)}
        times: dict[str, list[float]] = {name: [] for name in variants}
        engine.generate([prompt], variants["prompt_logprobs=5"], cache_salt="warm-up")
        for r in range(rounds):
            for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
                [result] = engine.generate([prompt], variants[name], cache_salt=uuid.uuid4().hex)
                assert result.num_cached_tokens == 0
                times[name].append(result.prefill_ms)
    finally:
        engine.close()
    med = {name: statistics.median(v) for name, v in times.items()}
    return {"prefill_ms": med, "ratio": med["prompt_logprobs=5"] / med["plain"]}


def render(choices: dict[str, Any], prompt: dict[str, Any]) -> str:
    s, x = choices["seconds"], choices["ratio"]
    p = prompt["ratio"]
    return "\n".join([
        "| measure | baseline | with the feature | ratio (target) |", "|---|---|---|---|",
        f"| 1P1D, {PROMPT_TOKENS}-token prompt, {NEW} tokens each: n = {CHOICES} vs n = 1 | {s[1]:.2f} s | "
        f"{s[CHOICES]:.2f} s | {x:.2f}x (<= {N_TARGET}, {'met' if x <= N_TARGET else 'MISSED'}) |",
        f"| KV bytes sent / prompt tokens computed, n = {CHOICES} vs n = 1 | {choices['kv_bytes'][1]:,} / "
        f"{choices['prompt_tokens_computed'][1]} | {choices['kv_bytes'][CHOICES]:,} / "
        f"{choices['prompt_tokens_computed'][CHOICES]} | {'once' if choices['computed_once'] else 'NOT ONCE'} |",
        f"| prefill of {PROMPT_TOKENS} tokens: prompt_logprobs=5 vs plain | {prompt['prefill_ms']['plain']:.0f} ms | "
        f"{prompt['prefill_ms']['prompt_logprobs=5']:.0f} ms | {p:.3f}x (<= {PROMPT_TARGET}, "
        f"{'met' if p <= PROMPT_TARGET else 'MISSED'}) |"])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="halfmoon bench choices", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1, help="threads per engine")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    engine = EngineConfig(dtype=args.dtype, num_threads=args.threads, num_blocks=1024, max_num_batched_tokens=512)
    started = time.perf_counter()
    choices = choices_part(engine, args.rounds)
    prompt = prompt_logprobs_part(engine, args.rounds + 1)
    out = {"bench": "choices", "dtype": args.dtype, "threads": args.threads, "rounds": args.rounds,
           "seconds": round(time.perf_counter() - started, 1), "choices": choices, "prompt_logprobs": prompt}
    print(json.dumps(out, indent=1) if args.json else render(choices, prompt), flush=True)
    met = choices["ratio"] <= N_TARGET and prompt["ratio"] <= PROMPT_TARGET
    if not choices["computed_once"]:
        print(f"n = {CHOICES} computed or sent the prompt more than once: a bug", flush=True)
    return 0 if met and choices["computed_once"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
