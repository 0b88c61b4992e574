"""deploy/gpu_check.sh phase (b): `halfmoon serve --device cuda`, one prefill and one decode
worker sharing one GPU, greedy completions through the official `openai` client token-identical
(as text) to transformers' greedy `generate` on the same GPU, fp32; the KV transfer path the
decode worker counted (its /metrics).

    python -m halfmoon.bench.gpu_serve_check --out FILE.json [--model smollm2] [--max-tokens 24]

Writes one JSON object: per prompt the two texts and whether they match, the path's bytes, the
start-up seconds. Exit 0 only when every completion matches and KV arrived staged."""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
           "Once upon a time, in a small village,")
READY_TIMEOUT_S = 240.0
PATH_METRIC = re.compile(r'^halfmoon_worker_kv_received_path_bytes_total\{.*path="(\w+)".*\} ([0-9.e+]+)$', re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model: str, http: int, grpc: int) -> list[str]:
    return [sys.executable, "-m", "halfmoon.cli.main", "serve", "--device", "cuda", "--prefill", "1", "--decode", "1",
            "--model", model, "--dtype", "float32", "--http-port", str(http), "--grpc-port", str(grpc),
            "--served-model-name", "check", "--kv-cache-gb", "2", "--host-cache-gb", "0", "--no-dashboard"]


def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float) -> float:
    """Seconds until GET /v1/models answers; RuntimeError when serve exits or time runs out."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"halfmoon serve exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            time.sleep(1.0)  # not listening yet: poll again (bounded by timeout_s)
    raise RuntimeError(f"halfmoon serve not ready after {timeout_s:.0f}s")


def path_bytes(metrics_text: str) -> dict[str, float]:
    """The decode worker's verified KV bytes by path, from the Prometheus text."""
    return {path: float(value) for path, value in PATH_METRIC.findall(metrics_text)}


def reference_texts(model: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """transformers' greedy continuations on CUDA, fp32, decoded by its own tokenizer."""
    import torch

    from halfmoon.bench.hf_reference import hf_model, hf_tokenizer
    from halfmoon.engine.loader import resolve_model_path

    path = resolve_model_path(model)
    hf, tok = hf_model(path, torch.float32).to("cuda"), hf_tokenizer(path)
    texts = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids], device="cuda"), do_sample=False, max_new_tokens=max_tokens,
                              pad_token_id=tok.eos_token_id)
            texts.append(tok.decode(out[0, len(ids):], skip_special_tokens=True))
    return texts


def check(model: str, max_tokens: int) -> dict[str, Any]:
    import openai

    from halfmoon.bench.hf_reference import hf_tokenizer
    from halfmoon.engine.loader import resolve_model_path

    tok = hf_tokenizer(resolve_model_path(model))
    prompts = [tok.encode(p) for p in PROMPTS]
    http, grpc = free_port(), free_port()
    base = f"http://127.0.0.1:{http}"
    proc = subprocess.Popen(serve_command(model, http, grpc))
    try:
        ready_s = wait_ready(base, proc, READY_TIMEOUT_S)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        ours = [client.completions.create(model="check", prompt=ids, max_tokens=max_tokens, temperature=0).choices[0].text
                for ids in prompts]
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
            paths = path_bytes(r.read().decode())
    finally:
        proc.terminate()
        proc.wait(60)
    theirs = reference_texts(model, prompts, max_tokens)
    rows = [{"prompt": p, "halfmoon": a, "transformers": b, "identical": a == b}
            for p, a, b in zip(PROMPTS, ours, theirs)]
    return {"ready_s": round(ready_s, 1), "completions": rows, "kv_bytes_by_path": paths,
            "identical": sum(r["identical"] for r in rows), "prompts": len(rows),
            "ok": all(r["identical"] for r in rows) and paths.get("staged", 0) > 0}


# what `halfmoon serve` and this check import beyond the CUDA tests' needs (the GPU image or .whl/)
NEEDS = ("ray", "grpc", "openai", "transformers", "redis")


def missing_modules(names: tuple[str, ...] = NEEDS) -> list[str]:
    import importlib.util

    return [n for n in names if importlib.util.find_spec(n) is None]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m halfmoon.bench.gpu_serve_check")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-tokens", type=int, default=24)
    args = p.parse_args(argv)
    missing = missing_modules()
    if missing:  # the phase fails and says why: nothing here is skipped quietly
        result: dict[str, Any] = {"ok": False, "missing": missing, "identical": 0, "prompts": len(PROMPTS),
                                  "kv_bytes_by_path": {}, "ready_s": None}
        args.out.write_text(json.dumps(result, indent=2))
        print(f"phase b cannot run: {', '.join(missing)} not importable (add them to the image or .whl/)")
        return 1
    result = check(args.model, args.max_tokens)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
