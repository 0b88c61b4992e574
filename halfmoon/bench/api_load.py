"""`halfmoon bench load`: many concurrent streaming clients against `halfmoon serve` (a soak test).

Half the clients speak gRPC (`Generate`), half the OpenAI HTTP API (SSE, chat and completions
alternating). Each loops until the time is up: a prompt from a fixed set, a random max_tokens,
the whole stream read and checked (final message / `[DONE]`, token count = usage). It reports
completed streams, documented rejections (RESOURCE_EXHAUSTED / 429), anything else as an error,
and the server's RSS over the run (sampled from /proc). Exit code 1 on any error or incomplete
stream. It starts its own `halfmoon serve` unless `--grpc-target` / `--http-url` are given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:",
           "Explain what a KV cache is in one sentence.", "Once upon a time", "def fibonacci(n):",
           "The quick brown fox", "Translate 'good morning' to French:"]


class MemorySample(NamedTuple):
    seconds: float
    rss: float  # MB, VmRSS
    anon: float  # MB, RssAnon
    completed: int  # streams completed by then


@dataclass
class Tally:
    completed: int = 0
    tokens: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    incomplete: int = 0
    memory: list[MemorySample] = field(default_factory=list)
    elapsed_s: float = 0.0  # until the last stream ended


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="halfmoon bench load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--max-tokens", default="4,32", help="min,max of each request's max_tokens")
    p.add_argument("--grpc-target", default=None, help="an existing server's gRPC address")
    p.add_argument("--http-url", default=None, help="an existing server's HTTP URL")
    p.add_argument("--server-pid", type=int, default=None, help="RSS of this pid (an existing server)")
    p.add_argument("--server-args", default="--colocated --threads 1 --no-redis --admission none",
                   help="flags of the `halfmoon serve` we start (default: the co-located engine without "
                        "admission: this soaks the front door; `bench serve --admission` measures admission)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write RSS and completions over time to this PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


# ---------------------------------------------------------------------- server


def start_server(extra: str, log: Path) -> tuple[subprocess.Popen[str], str, str]:
    cmd = [sys.executable, "-m", "halfmoon.cli.main", "serve", "--grpc-port", "0", "--http-port", "0", *extra.split()]
    out = open(log, "w")  # noqa: SIM115 - the child keeps writing it; closed with the process
    proc = subprocess.Popen(cmd, stdout=out, stderr=out, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        match = re.search(r"listening grpc=(\S+) http=(\S+)", log.read_text())
        if match:
            return proc, match.group(1), match.group(2)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"halfmoon serve did not come up: {log.read_text()[-2000:]}")


def memory_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, RssAnon) of `pid` in MB. RssAnon is what a leak grows; VmRSS also counts file pages
    (the memory-mapped weights cache), which the kernel drops and faults back in under pressure."""
    fields: dict[str, float] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                fields[key] = int(rest.split()[0]) / 1024
    if len(fields) != 2:
        raise RuntimeError(f"no VmRSS / RssAnon for pid {pid}")
    return fields["VmRSS"], fields["RssAnon"]


# ---------------------------------------------------------------------- clients


async def grpc_client(target: str, end: float, rng: random.Random, bounds: tuple[int, int], t: Tally) -> None:
    import grpc

    from halfmoon.v1 import generation_pb2 as pb
    from halfmoon.v1 import generation_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        while time.monotonic() < end:
            n = rng.randint(*bounds)
            req = pb.GenerateRequest(prompt=rng.choice(PROMPTS), max_tokens=n,
                                     sampling=pb.SamplingParams(temperature=0.7, seed=rng.randrange(2**31)))
            got, final = 0, None
            try:
                async for r in stub.Generate(req, timeout=300):
                    got += len(r.token_ids)
                    if r.HasField("final"):
                        final = r.final
            except grpc.aio.AioRpcError as e:
                _failed(t, e.code().name, e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details())
                continue
            _finished(t, final is not None and final.usage.completion_tokens == got, got)


async def http_client(url: str, end: float, rng: random.Random, bounds: tuple[int, int], t: Tally) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        chat = False
        while time.monotonic() < end:
            chat = not chat
            body = _http_body(chat, rng, bounds)
            path = "/v1/chat/completions" if chat else "/v1/completions"
            try:
                async with client.stream("POST", path, json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        _failed(t, str(r.status_code), r.status_code == 429, r.text[:200])
                        continue
                    ok, got = await _read_sse(r, chat)
            except httpx.HTTPError as e:
                _failed(t, type(e).__name__, False, str(e))
                continue
            _finished(t, ok, got)


def _http_body(chat: bool, rng: random.Random, bounds: tuple[int, int]) -> dict[str, Any]:
    prompt = rng.choice(PROMPTS)
    body: dict[str, Any] = {"model": "smollm2", "max_tokens": rng.randint(*bounds), "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": 0.7,
                            "seed": rng.randrange(2**31)}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def _read_sse(response: Any, chat: bool) -> tuple[bool, int]:
    """(complete: [DONE], a finish reason and usage all seen; completion tokens per usage)."""
    done = finished = False
    usage = 0
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            return False, 0
        if chunk.get("usage"):
            usage = chunk["usage"]["completion_tokens"]
        finished = finished or any(c.get("finish_reason") for c in chunk["choices"])
    return done and finished and usage > 0, usage


def _failed(t: Tally, code: str, documented: bool, detail: str) -> None:
    if documented:
        t.rejected[code] += 1
    else:
        t.errors.append(f"{code}: {detail}")


def _finished(t: Tally, complete: bool, tokens: int) -> None:
    if complete:
        t.completed += 1
        t.tokens += tokens
    else:
        t.incomplete += 1


async def sample_rss(pid: int | None, end: float, start: float, t: Tally) -> None:
    while pid is not None and time.monotonic() < end:
        t.memory.append(MemorySample(time.monotonic() - start, *memory_mb(pid), t.completed))
        await asyncio.sleep(2.0)


IDLE_S = 6.0  # RSS keeps being sampled this long after the last stream ended


async def run_load(args: argparse.Namespace, grpc_target: str, http_url: str, pid: int | None) -> Tally:
    t = Tally()
    lo, hi = (int(x) for x in args.max_tokens.split(","))
    start = time.monotonic()
    end = start + args.duration
    tasks = []
    for i in range(args.clients):
        rng = random.Random(args.seed * 1000 + i)
        client = grpc_client(grpc_target, end, rng, (lo, hi), t) if i % 2 == 0 else \
            http_client(http_url, end, rng, (lo, hi), t)
        tasks.append(asyncio.create_task(client))
    tasks.append(asyncio.create_task(sample_rss(pid, end, start, t)))
    await asyncio.gather(*tasks)
    t.elapsed_s = time.monotonic() - start
    await sample_rss(pid, time.monotonic() + IDLE_S, start, t)  # idle: what stays allocated
    return t


# ---------------------------------------------------------------------- report


def summary(args: argparse.Namespace, t: Tally, elapsed: float) -> dict[str, Any]:
    warm = [m for m in t.memory if m.seconds >= 0.25 * args.duration] or t.memory
    return {"clients": args.clients, "duration_s": round(elapsed, 1), "completed": t.completed,
            "tokens": t.tokens, "tokens_per_s": round(t.tokens / elapsed, 1),
            "rejected": dict(t.rejected), "errors": len(t.errors), "first_errors": t.errors[:5],
            "incomplete": t.incomplete,
            "rss_mb": _memory_summary([m.rss for m in t.memory], [m.rss for m in warm]),
            "anon_mb": _memory_summary([m.anon for m in t.memory], [m.anon for m in warm]),
            "memory_samples": [[_r(m.seconds), _r(m.rss), _r(m.anon), m.completed]
                               for m in t.memory],
            "ok": not t.errors and not t.incomplete and t.completed > 0}


def _memory_summary(all_mb: list[float], warm: list[float]) -> dict[str, float | None]:
    """Start / end / max, and two growths after warm-up: last minus first sample (noisy: a sample
    can land on a step's transient activations, +60 MB here) and the floor's growth, the lowest
    sample of the warm run's last third minus that of its first third: what stays allocated
    between steps, which is what a leak raises."""
    if not all_mb:
        return dict.fromkeys(("start", "after_warmup", "end", "max", "growth_after_warmup",
                              "floor_growth_after_warmup"))
    third = max(1, len(warm) // 3)
    return {"start": _r(all_mb[0]), "after_warmup": _r(warm[0]), "end": _r(all_mb[-1]),
            "max": _r(max(all_mb)), "growth_after_warmup": _r(warm[-1] - warm[0]),
            "floor_growth_after_warmup": _r(min(warm[-third:]) - min(warm[:third]))}


def _r(x: float) -> float:
    return round(x, 1)


def render(s: dict[str, Any], t: Tally) -> str:
    rss, anon = s["rss_mb"], s["anon_mb"]
    lines = [f"{s['clients']} streaming clients for {s['duration_s']} s: {s['completed']} streams complete, "
             f"{s['tokens']} tokens ({s['tokens_per_s']} tok/s)",
             f"rejected (documented): {s['rejected'] or 'none'}; errors: {s['errors']}; "
             f"incomplete streams: {s['incomplete']}",
             f"server RSS MB: start {rss['start']}, after warm-up {rss['after_warmup']}, end {rss['end']}, "
             f"max {rss['max']} (growth after warm-up {rss['growth_after_warmup']})",
             f"server anonymous MB (what a leak grows): start {anon['start']}, after warm-up "
             f"{anon['after_warmup']}, end {anon['end']} (growth after warm-up {anon['growth_after_warmup']}, "
             f"of its floor {anon['floor_growth_after_warmup']})"]
    lines += [f"  t={m.seconds:5.0f}s  RSS {m.rss:7.1f} MB  anonymous {m.anon:7.1f} MB"
              for m in t.memory[:: max(1, len(t.memory) // 10)]]
    lines += [f"  error: {e}" for e in s["first_errors"]]
    lines.append("OK" if s["ok"] else "FAILED")
    return "\n".join(lines)


def plot(path: str, t: Tally) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    seconds = [m.seconds for m in t.memory]
    ax.plot(seconds, [m.rss for m in t.memory], marker=".", label="RSS")
    ax.plot(seconds, [m.anon for m in t.memory], marker=".", label="anonymous (heap)")
    ax.legend()
    ax.set_xlabel("seconds")
    ax.set_ylabel("server memory (MB)")
    ax.set_title("halfmoon bench load: server memory under load")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    proc = None
    if args.grpc_target is None or args.http_url is None:
        log = Path(tempfile.mkdtemp(prefix="halfmoon-load-")) / "serve.log"
        print(f"halfmoon bench load: starting halfmoon serve (log {log}) ...", file=sys.stderr, flush=True)
        proc, args.grpc_target, args.http_url = start_server(args.server_args, log)
    pid = proc.pid if proc is not None else args.server_pid
    try:
        print(f"halfmoon bench load: {args.clients} clients for {args.duration:.0f} s against "
              f"{args.grpc_target} / {args.http_url}", file=sys.stderr, flush=True)
        tally = asyncio.run(run_load(args, args.grpc_target, args.http_url, pid))
        s = summary(args, tally, tally.elapsed_s)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    if args.plot:
        plot(args.plot, tally)
    print(json.dumps(s) if args.json else render(s, tally))
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
