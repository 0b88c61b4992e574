"""`halfmoon bench engine --device cuda`: Halfmoon on a GPU against transformers on the same GPU,
same dtype (bf16 by default here), CUDA graphs on and off, the engine bench's workloads.

    halfmoon bench engine --device cuda [--model M] [--attention-backend torch|flashinfer]
                          [--dtype bfloat16] [--quick] [--repeats N] [--json]

Three systems, each warmed up, then W1 / W2 / W3 back to back per repeat (bench/engine_bench.py):
`halfmoon graphs` (decode CUDA graphs, engine/cuda_graphs.py), `halfmoon eager` (--no-cuda-graphs)
and transformers (`generate`, eager attention, KV cache on, on the same GPU). Each Halfmoon
system's figures are ratios to transformers'; the targets (issue 36): W1 and W2 output tok/s
>= 3x transformers with graphs. Greedy agreement with transformers and the graph replays per
system are reported beside them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import torch

from halfmoon.bench.engine_bench import (BASELINE, FULL, QUICK, HalfmoonSystem, Measured, Sizes, System, TransformersSystem,
                                checks, engine_config, figures, load_transformers, make_workload, measure_once,
                                median_of, process_settings, warm_up)
from halfmoon.bench.report import Progress, machine_info, render_table, utc_now
from halfmoon.engine.config import torch_dtype
from halfmoon.engine.engine import Engine

CUDA_TARGETS = {"w1_tok_s": 3.0, "w2_tok_s": 3.0}
SYSTEMS = {"halfmoon graphs": True, "halfmoon eager": False}  # name -> cuda_graphs


def load_systems(args: argparse.Namespace, sizes: Sizes, progress: Progress) -> tuple[list[System], list[Engine]]:
    base = engine_config(args.dtype, sizes, args.threads, args.max_num_batched_tokens, "none", args.model)
    engines, systems = [], []
    for name, graphs in SYSTEMS.items():
        progress(f"loading {name} ({args.model}, {args.dtype}, {args.attention_backend} attention, cuda)")
        engine = Engine(dataclasses.replace(base, device="cuda", cuda_graphs=graphs,
                                            attention_backend=args.attention_backend))
        system = HalfmoonSystem(engine)
        system.name = name
        engines.append(engine)
        systems.append(system)
    progress(f"loading transformers ({args.model}, {args.dtype}, cuda)")
    hf = load_transformers(torch_dtype(args.dtype), args.model)
    systems.append(TransformersSystem(hf.model.to("cuda"), hf.pad_id))  # its ids follow the model's device
    return systems, engines


def report(args: argparse.Namespace, command: str, sizes: Sizes, medians: dict[str, Measured],
           engines: list[Engine]) -> dict[str, Any]:
    hf = medians[BASELINE]
    out: dict[str, Any] = {"benchmark": "engine-cuda", "command": command, "date": utc_now(),
                           "machine": {**machine_info(args.threads), "gpu": torch.cuda.get_device_name(0)},
                           "config": {"model": args.model, "dtype": args.dtype, "quick": args.quick,
                                      "repeats": args.repeats, "attention_backend": args.attention_backend},
                           "systems": {}}
    for (name, _), engine in zip(SYSTEMS.items(), engines):
        figs = figures(medians[name], hf, sizes, CUDA_TARGETS if engine.config.cuda_graphs else {})
        graphs = engine.runner.graphs
        out["systems"][name] = {
            "figures": {f.key: f.to_json(BASELINE) for f in figs}, "checks": checks(medians[name], hf),
            "graph_replays": graphs.replays if graphs is not None else 0,
            "graph_eager_decode_steps": graphs.eager if graphs is not None else 0}
    met = [f["met"] for f in out["systems"]["halfmoon graphs"]["figures"].values() if f["met"] is not None]
    out["targets_met"] = all(met)
    return out


def main(args: argparse.Namespace, command: str) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("halfmoon bench engine --device cuda: this machine sees no CUDA device")
    sizes = QUICK if args.quick else FULL
    progress = Progress()
    with process_settings(args.threads):
        systems, engines = load_systems(args, sizes, progress)
        work = make_workload(sizes, engines[0].model_config.vocab_size)
        progress("warming up every system")
        warm_up(systems, engines[0].model_config.vocab_size)
        runs = [measure_once(systems, work, sizes, progress) for _ in range(args.repeats)]
    medians = {s.name: median_of([r[s.name] for r in runs]) for s in systems}
    rep = report(args, command, sizes, medians, engines)
    if args.json:
        print(json.dumps(rep, indent=2), flush=True)
        return 0
    for name in SYSTEMS:
        figs = figures(medians[name], medians[BASELINE], sizes, CUDA_TARGETS)
        print(f"{name} vs {BASELINE} ({rep['machine']['gpu']}, {args.dtype})")
        print(render_table(figs, BASELINE))
    print(f"W1 tok/s graphs / eager: {medians['halfmoon graphs'].w1.tok_s / medians['halfmoon eager'].w1.tok_s:.2f}x")
    return 0
