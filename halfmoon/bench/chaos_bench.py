"""`halfmoon bench chaos`: what a client sees when a piece of the cluster dies under load.

It starts `halfmoon serve` (1 prefill + 1 decode worker, embedded Redis), and for each fault, `--runs`
times: opens `--streams` concurrent greedy streams of `--max-tokens` tokens, strikes once every
stream has its first tokens, and lets them finish. Faults: kill -9 of the decode worker's process,
of the prefill worker's, of the embedded Redis (its supervisor in `halfmoon serve` restarts it),
and every KV connection of the prefill
worker dropped (the prefill worker's drill verb, through Ray). Per fault it prints:

- client-visible errors (streams that ended in an error) and whether every stream got the same
  tokens as the undisturbed run of the same prompts (greedy: it must);
- the longest stall a stream saw (the largest gap between two of its chunks);
- time to serve again: from the strike until the struck worker answered a new request (for
  Redis: until the Conductor's index is healthy again), median over the runs;
- prompt tokens re-prefilled: what the Conductor sent to prefill again (a moved request's prompt is
  its prompt + the tokens already sent; `halfmoon_requests_reprefilled_tokens_total`).

`--standby 0,1` runs the whole set once per value (`halfmoon serve --standby N`: N warm spares
per role, issue 37), one server after the other; a worker kill strikes the role's serving worker
and, with standbys, waits before each strike until the role has its standby again. Time to serve
again is then from the kill until a request sent right after it is answered. With standbys it
also reports the memory of a standby's process (RSS, and USS: the pages only it holds).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

FAULTS = ("decode", "prefill", "redis", "kv-drop")
# Token-exact (fp32, unquantized; serve's default is bf16): every fault's streams are compared with
# the undisturbed run's tokens, and a recomputed or re-routed request must give the same ones.
SERVE_ARGS = ["--prefill", "1", "--decode", "1", "--worker-threads", "1", "--kv-transport", "tcp",
              "--admission", "none", "--dtype", "float32", "--quantization", "none"]
TOPICS = ["the sea", "a lighthouse", "the moon", "a red fox", "winter rain", "an old clock", "a river", "snow"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="halfmoon bench chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    p.add_argument("--runs", type=int, default=3, help="strikes per fault (time to serve again: their median)")
    p.add_argument("--streams", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--standby", default="0", help="comma-separated standby counts, one server each (e.g. 0,1)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None, help="write chaos_bench.json here")
    args = p.parse_args(argv)
    unknown = set(args.faults.split(",")) - set(FAULTS)
    if unknown:
        p.error(f"unknown faults {sorted(unknown)}; choose from {', '.join(FAULTS)}")
    try:
        args.standbys = [int(n) for n in args.standby.split(",")]
    except ValueError:
        p.error(f"--standby takes comma-separated integers, got {args.standby!r}")
    if any(n < 0 for n in args.standbys):
        p.error("--standby counts must be >= 0")
    return args


class Server:
    """`halfmoon serve` in its own process group; its HTTP / gRPC addresses and its processes."""

    def __init__(self, log: Path, standby: int = 0, serve_args: Sequence[str] = tuple(SERVE_ARGS)) -> None:
        """`serve_args`: the cluster's flags (the chaos bench's 1P1D by default; the soak's 1P2D)."""
        self.log = log
        self.standby = standby
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "halfmoon.cli.main", "serve", "--grpc-port", "0",
                                          "--http-port", "0", *serve_args, "--standby", str(standby)],
                                         stdout=out, stderr=out, text=True,
                                         start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.killed_redis = 0  # the pid the redis fault killed last
        match = self._wait(r"listening grpc=(\S+) http=(\S+)", 300)
        self.grpc, self.http = match.group(1), match.group(2)

    def _wait(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = re.search(pattern, self.log.read_text())
            if match:
                return match
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)  # polling the server's log for its address
        raise RuntimeError(f"halfmoon serve did not come up: {self.log.read_text()[-2000:]}")

    def pid_of(self, marker: str) -> int:
        """The pid of the one process of this server whose command line starts with `marker`."""
        import psutil

        found = [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)
                 if (cmd := _cmdline(p)) and cmd[0].startswith(marker)]
        if len(found) != 1:
            raise RuntimeError(f"expected one {marker} process, found {found}")
        return found[0]

    def serving(self, role: str) -> dict[str, Any]:
        """The live view of `role`'s serving worker (1P1D: one; a standby is not serving)."""
        return next(w for w in self.live()["workers"] if w["role"] == role and w["state"] in ("ready", "promoting"))

    def standbys_ready(self) -> bool:
        """Every role has its `standby` spares warmed up (after a kill: the restart's warm-up)."""
        ready = [w["role"] for w in self.live()["workers"] if w["state"] == "standby" and w["alive"]]
        return all(ready.count(role) >= self.standby for role in ("prefill", "decode"))

    def live(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.http + "/dashboard/api/live", timeout=10) as r:
            return json.load(r)

    def health(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(self.http + "/health", timeout=10) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            return json.load(e)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _cmdline(p: Any) -> list[str]:
    try:
        return p.cmdline()
    except Exception:  # gone, or not ours to read
        return []


def stream_all(target: str, prompts: list[list[int]], max_tokens: int, strike: Callable[[], None] | None,
               warm: int = 4, ready: Callable[[], bool] | None = None) -> list[dict[str, Any]]:
    """Every prompt as one greedy stream at once; `strike` once each has `warm` tokens, or, given
    `ready`, as soon as it holds (e.g. prefills queued on the worker to strike)."""
    import grpc

    from halfmoon.v1 import generation_pb2 as pb
    from halfmoon.v1 import generation_pb2_grpc as pb_grpc

    results: list[dict[str, Any]] = [{"tokens": [], "gaps": [], "error": None} for _ in prompts]
    warmed = [threading.Event() for _ in prompts]

    def one(i: int) -> None:
        r = results[i]
        try:
            with grpc.insecure_channel(target) as channel:
                req = pb.GenerateRequest(prompt_token_ids=prompts[i], max_tokens=max_tokens, ignore_eos=True)
                last = time.monotonic()
                for chunk in pb_grpc.GenerationStub(channel).Generate(req, timeout=600):
                    if chunk.token_ids:
                        now = time.monotonic()
                        r["gaps"].append(now - last)
                        last = now
                    r["tokens"].extend(chunk.token_ids)
                    if len(r["tokens"]) >= warm:
                        warmed[i].set()
        except Exception as e:  # a client-visible error: counted, not raised
            detail = e.details() if hasattr(e, "details") else str(e)
            r["error"] = f"{type(e).__name__}: {detail}"
        finally:
            warmed[i].set()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    if strike is not None and ready is not None:
        deadline = time.monotonic() + 300
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the server's view of its queues
        strike()
    elif strike is not None:
        for w in warmed:
            w.wait(300)
        strike()
    for t in threads:
        t.join(900)
    return results


def _queued(server: Server, worker_id: str) -> int:
    return next(w["queue_depth"] for w in server.live()["workers"] if w["id"] == worker_id)


def reprefilled(server: Server) -> int:
    """The Conductor's count of prompt tokens it sent to prefill again (re-runs and moves)."""
    with urllib.request.urlopen(server.http + "/metrics", timeout=10) as r:
        text = r.read().decode()
    match = re.search(r"^halfmoon_requests_reprefilled_tokens_total (\S+)$", text, re.MULTILINE)
    return int(float(match.group(1))) if match else 0


def served_again(server: Server, worker_id: str | None, struck: float, probe: list[int]) -> float:
    """Seconds from the strike until a request sent right after it is answered (a dead worker's
    request moves to a promoted standby or waits for the restart: the Conductor's own path);
    Redis: until /health is ok again (the index re-synced). Polled while the streams still run."""
    deadline = struck + 300
    while time.monotonic() < deadline:
        if worker_id is None:  # Redis: a new redis-server answers and the Conductor's index is healthy
            try:
                back = server.pid_of(_redis_marker()) != server.killed_redis
            except RuntimeError:  # not restarted yet
                back = False
            if back and server.health().get("status") == "ok":
                return time.monotonic() - struck
        elif not stream_all(server.grpc, [probe], 2, None)[0]["error"]:
            return time.monotonic() - struck
        time.sleep(0.05)  # polling the server's own view of its workers
    raise RuntimeError(f"{worker_id or 'the index'} did not come back within 300 s")


def strike_for(fault: str, server: Server) -> tuple[Callable[[], None], str | None]:
    """The fault as a callable, and the worker it strikes (None: Redis / the connections)."""
    if fault in ("decode", "prefill"):
        victim = server.serving(fault)
        return (lambda: os.kill(victim["pid"], signal.SIGKILL)), victim["id"]
    if fault == "redis":
        def kill_redis() -> None:
            server.killed_redis = server.pid_of(_redis_marker())
            os.kill(server.killed_redis, signal.SIGKILL)

        return kill_redis, None

    def drop() -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address="auto", namespace="halfmoon", log_to_driver=False)
        serving = server.serving("prefill")["id"]
        ray.get(ray.get_actor(serving, namespace="halfmoon").drop_kv_connections.remote(), timeout=30)

    return drop, None


def _await_standbys(server: Server, timeout_s: float = 180.0) -> None:
    """Until every role has its standbys warmed up again (the last kill's restart)."""
    deadline = time.monotonic() + timeout_s
    while not server.standbys_ready():
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the standbys were not all warmed up again within {timeout_s:g} s")
        time.sleep(0.2)  # polling the server's view of its standbys


def standby_memory(server: Server) -> dict[str, Any] | None:
    """RSS and USS (MiB) of each standby's process, and of the serving workers' for comparison."""
    import psutil

    if not server.standby:
        return None
    out: dict[str, Any] = {}
    for w in server.live()["workers"]:
        info = psutil.Process(w["pid"]).memory_full_info()
        out[w["id"]] = {"role": w["role"], "state": w["state"], "rss_mib": round(info.rss / 2**20, 1),
                        "uss_mib": round(info.uss / 2**20, 1)}
    return out


def _redis_marker() -> str:
    from halfmoon.kvpool.redis_server import bundled_redis_server

    return str(bundled_redis_server())


def run_fault(server: Server, fault: str, prompts: list[list[int]], want: list[list[int]], args: argparse.Namespace,
              probe: list[int]) -> dict[str, Any]:
    runs = []
    for _ in range(args.runs):
        _await_standbys(server)
        strike, worker = strike_for(fault, server)
        before = reprefilled(server)
        again: list[float] = []
        watcher: list[threading.Thread] = []

        def struck() -> None:
            at = time.monotonic()
            strike()
            if fault != "kv-drop":  # measured while the streams still run
                watch = threading.Thread(target=lambda: again.append(served_again(server, worker, at, probe)),
                                         daemon=True)
                watch.start()
                watcher.append(watch)

        # The prefill worker is struck with prefills queued on it; the others mid-stream.
        ready = (lambda: _queued(server, worker) > 0) if fault == "prefill" else None
        results = stream_all(server.grpc, prompts, args.max_tokens, struck, ready=ready)
        for watch in watcher:
            watch.join(300)
        runs.append({"errors": sum(r["error"] is not None for r in results),
                     "identical": sum(r["tokens"] == w for r, w in zip(results, want, strict=True)),
                     "longest_stall_s": round(max(max(r["gaps"], default=0.0) for r in results), 3),
                     "serve_again_s": round(again[0], 3) if again else None,
                     "reprefilled_tokens": reprefilled(server) - before,
                     "error_samples": [r["error"] for r in results if r["error"]][:2]})
    agains = [r["serve_again_s"] for r in runs if r["serve_again_s"] is not None]
    return {"fault": fault, "runs": runs, "errors": sum(r["errors"] for r in runs),
            "identical": f"{sum(r['identical'] for r in runs)}/{len(runs) * len(prompts)}",
            "longest_stall_s": max(r["longest_stall_s"] for r in runs),
            "serve_again_median_s": round(statistics.median(agains), 3) if agains else None,
            "reprefilled_tokens": sum(r["reprefilled_tokens"] for r in runs)}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="halfmoon-chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    say = (lambda _m: None) if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    from halfmoon.engine.tokenizer import Tokenizer
    from halfmoon.engine.loader import resolve_model_path

    tok = Tokenizer.from_gguf(resolve_model_path("smollm2"))
    prompts = [tok.encode(f"Write about {TOPICS[i % len(TOPICS)]}. Describe it slowly.") for i in range(args.streams)]
    probe = tok.encode("The capital of France is")
    clusters = [run_cluster(out, n, prompts, probe, args, say) for n in args.standbys]
    result = {"benchmark": "chaos", "streams": args.streams, "max_tokens": args.max_tokens, "runs": args.runs,
              "serve_args": SERVE_ARGS, "clusters": clusters}
    (out / "chaos_bench.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result) if args.json else render(result))
    return 0 if all(f["errors"] == 0 for c in clusters for f in c["faults"]) else 1


def run_cluster(out: Path, standby: int, prompts: list[list[int]], probe: list[int], args: argparse.Namespace,
                say: Callable[[str], None]) -> dict[str, Any]:
    """Every fault on one `halfmoon serve --standby <standby>`; its results (and standby memory)."""
    server = Server(out / f"serve-standby{standby}.log", standby)
    try:
        say(f"halfmoon serve --standby {standby} up at {server.grpc}; the undisturbed run ...")
        want = [r["tokens"] for r in stream_all(server.grpc, prompts, args.max_tokens, None)]
        _await_standbys(server)
        memory = standby_memory(server)
        results = []
        for fault in args.faults.split(","):
            say(f"fault {fault}: {args.runs} strike(s) on {args.streams} streams of {args.max_tokens} tokens ...")
            results.append(run_fault(server, fault, prompts, want, args, probe))
    finally:
        server.stop()
    return {"standby": standby, "faults": results, "memory": memory}


def render(result: dict[str, Any]) -> str:
    lines = [f"halfmoon bench chaos: {result['streams']} greedy streams of {result['max_tokens']} tokens, "
             f"{result['runs']} strike(s) per fault (1P1D)"]
    for c in result["clusters"]:
        lines += [f"--standby {c['standby']}",
                  f"{'fault':10}{'errors':>8}{'identical':>11}{'longest stall s':>17}{'serve again s (median)':>24}"
                  f"{'re-prefilled tok':>18}"]
        for f in c["faults"]:
            again = "-" if f["serve_again_median_s"] is None else f"{f['serve_again_median_s']:.2f}"
            lines.append(f"{f['fault']:10}{f['errors']:>8}{f['identical']:>11}{f['longest_stall_s']:>17.2f}"
                         f"{again:>24}{f['reprefilled_tokens']:>18}")
        for wid, m in sorted((c["memory"] or {}).items()):
            lines.append(f"  {wid} ({m['role']}, {m['state']}): RSS {m['rss_mib']:.0f} MiB, USS {m['uss_mib']:.0f} MiB")
    return "\n".join(lines)
