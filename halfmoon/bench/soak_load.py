"""The soak's load and its watchers: open-loop greedy gRPC streams from a Mooncake-format trace,
every outcome recorded; a sampler of RSS per process and free blocks per pool; the end-of-run
integrity checks and whether /health, /metrics and the dashboard agree with them."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

# gRPC codes the front door documents as refusals (4xx / 429); anything else is an error.
REFUSALS = frozenset({"RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "OUT_OF_RANGE", "FAILED_PRECONDITION"})


@dataclass
class Outcome:
    """One client request and what it saw."""

    index: int  # the request's prompt (index into the unique prompts)
    sent_s: float
    first_s: float | None = None
    end_s: float | None = None
    tokens: list[int] = field(default_factory=list)
    status: str = "running"  # ok | refused:<code> | error:<code>
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"i": self.index, "sent_s": round(self.sent_s, 3), "status": self.status,
                "ttft_s": None if self.first_s is None else round(self.first_s - self.sent_s, 4),
                "end_s": None if self.end_s is None else round(self.end_s, 3), "tokens": len(self.tokens),
                "detail": self.detail}


def trace_prompts(trace: Path, scale_tokens: int, max_tokens: int,
                  first: int = 0) -> tuple[list[float], list[tuple[list[int], int]]]:
    """The trace's arrival times (s) and each line's (prompt ids, max_tokens); `first` > 0: its
    first lines only."""
    from halfmoon.bench.trace import read_trace, synthesize_tokens

    reqs = list(read_trace(trace))[:first or None]
    arrivals = [r.timestamp / 1000.0 for r in reqs]
    prompts = [([int(t) for t in synthesize_tokens(r, scale_tokens=scale_tokens)], min(r.output_length, max_tokens))
               for r in reqs]
    return arrivals, prompts


def one_request(target: str, prompt: list[int], max_tokens: int, out: Outcome, t0: float) -> None:
    from halfmoon.v1 import generation_pb2 as pb
    from halfmoon.v1 import generation_pb2_grpc as pb_grpc

    try:
        with grpc.insecure_channel(target) as channel:
            req = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
                                     sampling=pb.SamplingParams(temperature=0.0))  # greedy
            for chunk in pb_grpc.GenerationStub(channel).Generate(req, timeout=600):
                if chunk.token_ids and out.first_s is None:
                    out.first_s = time.monotonic() - t0
                out.tokens.extend(chunk.token_ids)
        out.status = "ok"
    except grpc.RpcError as e:
        code = e.code().name if e.code() is not None else "UNKNOWN"
        out.status = f"refused:{code}" if code in REFUSALS else f"error:{code}"
        out.detail = str(e.details())[:300]
    except Exception as e:  # a client-visible failure of another kind: recorded as an error
        out.status = f"error:{type(e).__name__}"
        out.detail = str(e)[:300]
    finally:
        out.end_s = time.monotonic() - t0


class OpenLoop:
    """Sends the trace's requests at their (rescaled) times, looping the trace, until `stop_s`;
    never waits on an answer before sending the next (open loop)."""

    def __init__(self, target: str, arrivals: list[float], prompts: list[tuple[list[int], int]], rps: float,
                 t0: float, stop_s: float) -> None:
        span = max(arrivals[-1] - arrivals[0], 1e-3) * len(arrivals) / max(len(arrivals) - 1, 1)
        self.scale = len(arrivals) / (span * rps)  # trace seconds -> run seconds at `rps` on average
        self.period = span * self.scale
        self.target, self.arrivals, self.prompts, self.t0, self.stop_s = target, arrivals, prompts, t0, stop_s
        self.outcomes: list[Outcome] = []
        self._threads: list[threading.Thread] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        base, lap = self.arrivals[0], 0
        while True:
            for i, a in enumerate(self.arrivals):
                at = lap * self.period + (a - base) * self.scale
                if at >= self.stop_s:
                    return
                wait = at - (time.monotonic() - self.t0)
                if wait > 0:
                    time.sleep(wait)  # the open loop's clock: the next arrival time
                out = Outcome(i, time.monotonic() - self.t0)
                self.outcomes.append(out)
                prompt, max_tokens = self.prompts[i]
                t = threading.Thread(target=one_request, args=(self.target, prompt, max_tokens, out, self.t0),
                                     daemon=True)
                t.start()
                self._threads.append(t)
            lap += 1

    def join(self, timeout_s: float) -> bool:
        self.thread.join(timeout_s)
        deadline = time.monotonic() + timeout_s
        for t in list(self._threads):
            t.join(max(deadline - time.monotonic(), 0.1))
        return not any(t.is_alive() for t in self._threads)


def reference(target: str, prompts: list[tuple[list[int], int]], concurrency: int = 4) -> list[list[int]]:
    """Every unique prompt once through the undisturbed cluster: its greedy tokens. Raises
    RuntimeError naming the first failure when any failed (an undisturbed cluster must serve)."""
    out: list[list[int] | None] = [None] * len(prompts)
    failed: list[str] = []
    lock, todo = threading.Lock(), list(range(len(prompts)))

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            o = Outcome(i, 0.0)
            one_request(target, prompts[i][0], prompts[i][1], o, time.monotonic())
            out[i] = o.tokens if o.status == "ok" else None
            if o.status != "ok":
                failed.append(f"prompt {i}: {o.status} {o.detail}")

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise RuntimeError(f"the undisturbed reference failed for {len(failed)} prompts: {failed[:2]}")
    return [tokens for tokens in out if tokens is not None]


class Sampler:
    """Every `every_s`: RSS of each process of the server (labelled: the Conductor, each worker
    by id, redis-server, Ray's own) and free device blocks of each worker's pool."""

    def __init__(self, server: Any, t0: float, every_s: float = 2.0) -> None:
        self.server, self.t0, self.every_s = server, t0, every_s
        self.rss: list[dict[str, Any]] = []  # {t, label, pid, rss_mib}
        self.blocks: list[dict[str, Any]] = []  # {t, worker, free, total}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.sample()
            except Exception:  # the Conductor busy for a moment (a fault): the next sample
                continue

    def sample(self) -> None:
        import psutil

        t = time.monotonic() - self.t0
        workers = self.server.live()["workers"]
        names = {w["pid"]: w["id"] for w in workers}
        root = psutil.Process(self.server.proc.pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                label = "conductor" if p.pid == root.pid else names.get(p.pid) or _label(p.cmdline())
                self.rss.append({"t": round(t, 2), "label": label, "pid": p.pid,
                                 "rss_mib": round(p.memory_info().rss / 2**20, 1)})
            except psutil.Error:  # gone between listing and reading
                continue
        for w in workers:
            device = (w.get("kv") or {}).get("device")
            if device:
                self.blocks.append({"t": round(t, 2), "worker": w["id"], "free": device["free"],
                                    "total": device["total"]})

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(10)


def _label(cmd: list[str]) -> str:
    if not cmd:
        return "?"
    name = Path(cmd[0]).name
    if "redis-server" in name:
        return "redis-server"
    if name.startswith("python"):
        for part in cmd[1:]:
            if part.endswith(".py"):
                return Path(part).stem
        return "python"
    return name.split()[0][:30]


def integrity(cluster: Any) -> dict[str, Any]:
    """Every worker's own integrity check (its KV bookkeeping), through Ray: per worker its report
    or its problems, and whether every block is free or cached and nothing is held."""
    import ray

    from halfmoon.core.messages import IntegrityError

    out: dict[str, Any] = {}
    for w in cluster.server.live()["workers"]:
        try:
            rep = ray.get(cluster.actor(w["id"]).check_integrity.remote(), timeout=60)
            # a decode worker's blocks all free (its prefix cache counts free); nothing held anywhere
            full = rep.free_blocks == rep.total_blocks or w["role"] != "decode"
            clean = rep.requests == 0 and rep.reserved_blocks == 0 and full
            out[w["id"]] = {"ok": clean, "role": w["role"], "free": rep.free_blocks, "total": rep.total_blocks,
                            "requests": rep.requests, "reserved": rep.reserved_blocks, "problems": []}
        except IntegrityError as e:
            out[w["id"]] = {"ok": False, "role": w["role"], "problems": list(e.problems)}
        except Exception as e:  # unreachable worker: the check failed
            out[w["id"]] = {"ok": False, "role": w["role"], "problems": [f"{type(e).__name__}: {e}"]}
    return out


def leases(server: Any) -> dict[str, int]:
    """Read leases and unpublished reservations left in the cluster index's Redis."""
    import psutil
    import redis

    from halfmoon.bench.chaos_bench import _redis_marker

    proc = psutil.Process(server.pid_of(_redis_marker()))
    port = next(c.laddr.port for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN)
    r = redis.Redis(host="127.0.0.1", port=port)
    return {"leases": sum(1 for _ in r.scan_iter(match="*:l:*", count=1000)),
            "reservations": sum(r.zcard(k) for k in r.scan_iter(match="*:r:*", count=1000))}


def agreement(server: Any, checks: dict[str, Any]) -> dict[str, Any]:
    """Whether /health, /metrics and the dashboard's live view say what the integrity checks say:
    health ok iff every check passed; free device blocks per worker equal in all three."""
    health = server.health()
    with urllib.request.urlopen(server.http + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    free_metric = {}
    for m in re.finditer(r"^halfmoon_worker_kv_blocks\{([^}]*)\} (\S+)$", metrics, re.MULTILINE):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("tier") == "device" and labels.get("state") == "free":
            free_metric[labels["worker"]] = int(float(m.group(2)))
    live = {w["id"]: w for w in server.live()["workers"]}
    all_ok = all(c["ok"] for c in checks.values())
    problems = []
    if (health.get("status") == "ok") != all_ok:
        problems.append(f"/health says {health.get('status')!r}, integrity checks {'pass' if all_ok else 'fail'}")
    for wid, c in checks.items():
        if "free" not in c:
            continue
        dash = ((live.get(wid) or {}).get("kv") or {}).get("device") or {}
        if free_metric.get(wid) != c["free"]:
            problems.append(f"{wid}: /metrics free blocks {free_metric.get(wid)} != integrity {c['free']}")
        if dash.get("free") != c["free"]:
            problems.append(f"{wid}: dashboard free blocks {dash.get('free')} != integrity {c['free']}")
        if not (live.get(wid) or {}).get("alive"):
            problems.append(f"{wid}: dashboard says not alive, its integrity check answered")
    seen = [line for line in metrics.splitlines() if "kv_blocks" in line and not line.startswith("#")][:12]
    return {"agree": not problems, "problems": problems, "health": health.get("status"),
            "metrics_kv_lines": [] if not problems else seen}
