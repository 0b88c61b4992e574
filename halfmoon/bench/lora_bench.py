"""`halfmoon bench lora`: what serving many LoRA adapters in one batch costs, against the same
engine decoding the same requests on the base model (the baseline, same run).

1. **Mixed-adapter decode** (target: >= 0.8x the base model's tokens/s). SmolLM2-135M, 32
   requests (the prompts of bench/data/open_prompts.jsonl, cycled), greedy, 64 tokens each, in one
   batch: all on the base model, or spread over 8 adapters of rank 16 on every projection (q, k,
   v, o, gate, up, down; 4 requests each). `--rounds` rounds alternating base / adapters, each
   round's order flipped (ABBA); the median over rounds of the batch's decode tokens/s (32 /
   the mean TPOT). The adapters are resident before timing (their first read is part 2).
2. **Loading an adapter** (target: < 1 s for rank 16 on SmolLM2). Each of the 8 adapters read
   from its folder, checked against the model and laid out for the slots (`LoraPool.preload`),
   then copied into a slot (`activate`), cold: median and max.

The adapters are random (A, B ~ N(0, 1/fan_in), B scaled so outputs change), written as PEFT
writes them (`adapter_config.json` + `adapter_model.safetensors`, keys `base_model.model.model.
layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`); `write_adapter` is the writer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from halfmoon.core.adapters import TARGET_MODULES, AdapterRef, LoraShapes
from halfmoon.core.params import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.engine.lora import read_files

DATA = Path(__file__).parent / "data"
NEW = 64
BATCH = 32
ADAPTERS = 8
RANK = 16
THROUGHPUT_TARGET = 0.8  # adapters' tokens/s / base model's, at least
LOAD_TARGET_S = 1.0
BASE_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def write_adapter(folder: Path, shapes: LoraShapes, rank: int, seed: int,
                  targets: Sequence[str] = TARGET_MODULES, base_name: str = BASE_NAME, alpha: float = 32.0) -> Path:
    """A random rank-`rank` LoRA adapter of a model of `shapes`, in PEFT's files."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shapes.num_layers):
        for module in targets:
            fan_in, fan_out = shapes.features(module)
            group = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{group}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * fan_in ** -0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * (0.5 / rank) ** 0.5
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
              "base_model_name_or_path": base_name, "bias": "none", "lora_dropout": 0.0,
              "task_type": "CAUSAL_LM", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return folder


def prompts(engine: Engine, n: int) -> list[list[int]]:
    texts = [json.loads(line)["prompt"] for line in (DATA / "open_prompts.jsonl").read_text().splitlines() if line.strip()]
    return [engine.tokenizer.encode(texts[i % len(texts)]) for i in range(n)]


def tokens_per_s(engine: Engine, batch: list[list[int]], adapters: Sequence[AdapterRef | None]) -> float:
    """The batch's decode tokens/s: requests over the mean time per output token."""
    params = [SamplingParams(max_tokens=NEW, ignore_eos=True, adapter=adapters[i % len(adapters)])
              for i in range(len(batch))]
    tpot = statistics.fmean(r.tpot_ms for r in engine.generate(batch, params))
    return len(batch) * 1e3 / tpot


def measure_decode(engine: Engine, batch: list[list[int]], refs: list[AdapterRef], rounds: int) -> dict[str, Any]:
    variants: dict[str, list[AdapterRef | None]] = {"base": [None], "adapters": list(refs)}
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
            rates[name].append(tokens_per_s(engine, batch, variants[name]))
    medians = {name: statistics.median(v) for name, v in rates.items()}
    return {"tokens_per_s": medians, "rounds": rates, "ratio": medians["adapters"] / medians["base"]}


def measure_load(engine: Engine, refs: list[AdapterRef]) -> dict[str, Any]:
    """Cold: read + check + lay out (preload), then the copy into a slot (activate)."""
    assert engine.lora is not None
    read, page = [], []
    for ref in refs:
        start = time.perf_counter()
        engine.lora.preload(ref)
        read.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.lora.activate([ref])
        page.append(time.perf_counter() - start)
    total = [a + b for a, b in zip(read, page)]
    return {"read_s_median": statistics.median(read), "page_in_s_median": statistics.median(page),
            "total_s_median": statistics.median(total), "total_s_max": max(total),
            "adapter_mb": read_files(refs[0].path, refs[0].name).nbytes / 1e6}


def render(decode: dict[str, Any], load: dict[str, Any], dtype: str) -> str:
    t = decode["tokens_per_s"]
    ok_decode = "met" if decode["ratio"] >= THROUGHPUT_TARGET else "MISSED"
    ok_load = "met" if load["total_s_max"] < LOAD_TARGET_S else "MISSED"
    return "\n".join([
        f"| SmolLM2-135M {dtype} | base model | {ADAPTERS} adapters, rank {RANK} | ratio (target >= {THROUGHPUT_TARGET}) |",
        "|---|---|---|---|",
        f"| decode, batch {BATCH}, tokens/s | {t['base']:.1f} | {t['adapters']:.1f} | {decode['ratio']:.3f}x, {ok_decode} |",
        "",
        f"| loading one adapter (rank {RANK}, {load['adapter_mb']:.1f} MB) | median | max (target < {LOAD_TARGET_S:g} s) |",
        "|---|---|---|",
        f"| read + check + lay out | {load['read_s_median'] * 1e3:.0f} ms | |",
        f"| copy into a slot | {load['page_in_s_median'] * 1e3:.1f} ms | |",
        f"| total | {load['total_s_median'] * 1e3:.0f} ms | {load['total_s_max'] * 1e3:.0f} ms, {ok_load} |",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="halfmoon bench lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    engine = Engine(EngineConfig(dtype=args.dtype, num_threads=args.threads, num_blocks=2048,
                                 max_loras=ADAPTERS, max_lora_rank=RANK, max_cpu_loras=ADAPTERS,
                                 max_num_seqs=BATCH))
    assert engine.lora is not None
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="halfmoon-lora-bench-") as tmp:
        refs = []
        for i in range(ADAPTERS):
            folder = write_adapter(Path(tmp) / f"adapter-{i}", engine.lora.shapes, RANK, seed=i)
            refs.append(AdapterRef(f"adapter-{i}", str(folder), read_files(folder, f"adapter-{i}").digest))
        load = measure_load(engine, refs)
        batch = prompts(engine, BATCH)
        engine.generate(batch[:ADAPTERS], SamplingParams(max_tokens=4))  # warm-up
        decode = measure_decode(engine, batch, refs, args.rounds)
    engine.pool.check_integrity()
    engine.lora.check()
    out = {"bench": "lora", "dtype": args.dtype, "threads": args.threads, "rounds": args.rounds,
           "seconds": round(time.perf_counter() - started, 1), "decode": decode, "load": load}
    print(json.dumps(out, indent=1) if args.json else render(decode, load, args.dtype), flush=True)
    return 0 if decode["ratio"] >= THROUGHPUT_TARGET and load["total_s_max"] < LOAD_TARGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
