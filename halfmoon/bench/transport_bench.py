"""`halfmoon bench transport`: the KV transport against its raw baselines, and layer pipelining.

1. Throughput per backend on loopback, receiver in another process, one sender thread:
   transfer units of 1 MB .. 256 MB written straight into the receiver's KV tensor (checksums
   on), next to the raw figure of the same run: plain Python sockets (`sendall` / `recv_into`
   one buffer) for tcp, `ucx_perftest` (tag_bw, same UCX_TLS) for ucxx. Target: >= 70% of raw
   for units >= 8 MB.

   The ucxx baseline is like for like: perftest runs with the UCX settings the backend runs
   with (transport.ucxx_backend.UCX_ENV_DEFAULTS) and, like the backend's endpoints, with peer
   error handling (`-e`: a dead peer fails pending operations instead of hanging them, which
   the fault tests need). On one host that mode rules out CMA's zero-copy read, so UCX moves
   shared-memory rendezvous data by copy-in / copy-out through sysv fragments. perftest without
   `-e` (CMA) is printed beside it as a second reference. Two more references split the gap:
   the backend's ucxx channel alone (no KV protocol) without and with the protocol's checksums
   (xxh3-64 of every frame on both ends, which the issue requires): the second is the ceiling
   for a verified transfer. Baseline, references and backend take turns round by round, so load
   from elsewhere on the machine hits all alike.
2. Layer-pipelined vs transfer-after-prefill, SmolLM2 prompts (512, 2048, 8191 tokens): time
   from prefill start until the decode side holds every verified layer. The baseline is the
   prefill, then the whole transfer (t_transfer). Pipelined, only the part of the transfer still
   running when the last forward pass returns is exposed (t_exposed = ready - compute end);
   hidden = 1 - t_exposed / t_transfer (measured within one run, so prefill-time noise between
   runs does not enter it). Target >= 80% hidden at 2048 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from halfmoon.bench.report import Progress, machine_info, ruled, utc_now
from halfmoon.core.blocks import cdiv

MB = 1 << 20
# Throughput layout: 16 tokens x 4 heads x 64 dims fp32 = 16 KB slabs, 32 KB per block-layer.
THROUGHPUT_SHAPE = (1, 2, 8192, 16, 4, 64)
UCX_TLS_DEFAULT = ("tcp", "sm,tcp,self")
# Loopback only (UCX would otherwise also stripe over the host's other interfaces), and the same
# TCP tuning the ucxx backend applies by default, so the ceiling is measured like-for-like.
UCX_LOOPBACK_ENV = {"UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_TCP_TX_SEG_SIZE": "1m",
                    "UCX_TCP_RX_SEG_SIZE": "1m", "UCX_TCP_SNDBUF": "8m", "UCX_TCP_RCVBUF": "8m"}


class Peer:
    """A transport peer (`module`, default `bench.transport_peer`) in its own process, driven by
    JSON lines; `first` is the first line it printed (its address)."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None,
                 module: str = "halfmoon.bench.transport_peer", cwd: str | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=cwd,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        self.first = self.read()

    def ask(self, **msg: Any) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"transport peer exited with code {self.proc.wait()}")
        return json.loads(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask(op="quit")
            except (RuntimeError, BrokenPipeError):
                pass  # already gone
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------- 1. throughput


def count_for(nbytes: int, budget_bytes: int) -> int:
    return max(3, min(64, budget_bytes // nbytes))


def kv_throughput(backend: str, sizes: Sequence[int], budget: int, env: dict[str, str] | None,
                  rounds: int) -> dict[int, float]:
    """GB/s of the transport for each unit size (bytes): sender and receiver each in their own
    process (UCX's configuration is per process, so each UCX_TLS gets fresh ones)."""
    shape = ",".join(map(str, THROUGHPUT_SHAPE))
    unit = 2 * THROUGHPUT_SHAPE[3] * THROUGHPUT_SHAPE[4] * THROUGHPUT_SHAPE[5] * 4
    plan = [[size, rounds, [f"u{size}-{i}" for i in range(rounds * count_for(size, budget) + 1)],
             list(range(size // unit))] for size in sizes]
    receiver = Peer(["kv", "--backend", backend, "--shape", shape], env)
    try:
        for _, _, rids, blocks in plan:
            receiver.ask(op="expect", rids=rids, blocks=blocks)
        sender = Peer(["send", "--backend", backend, "--shape", shape, "--address", receiver.first["address"],
                       "--plan", json.dumps(plan)], env)
        sender.close()
        check = receiver.ask(op="wait", rids=[rid for _, _, rids, _ in plan for rid in rids], timeout=10)
        if not check.get("ok"):
            raise RuntimeError(f"the receiver did not verify every unit: {check}")
        return {int(size): rate for size, rate in sender.first["gbps"].items()}
    finally:
        receiver.close()


def socket_throughput(sizes: Sequence[int], budget: int, rounds: int) -> dict[int, float]:
    """GB/s of plain Python sockets between two processes (sendall / recv_into one buffer),
    best of `rounds`."""
    return {size: max(_socket_rate(size, count_for(size, budget)) for _ in range(rounds)) for size in sizes}


def _socket_rate(size: int, count: int) -> float:
    import socket

    peer = Peer(["socket", "--nbytes", str(size), "--count", str(count + 1)])
    try:
        sock = socket.create_connection(("127.0.0.1", peer.first["port"]))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        buf = memoryview(bytearray(os.urandom(1024)) * (size // 1024))
        sock.sendall(buf)  # warm-up
        start = time.perf_counter()
        for _ in range(count):
            sock.sendall(buf)
        sock.recv(1)
        rate = count * size / (time.perf_counter() - start) / 1e9
        sock.close()
        return rate
    finally:
        peer.close()


def channel_throughput(sizes: Sequence[int], budget: int, env: dict[str, str],
                       checksums: bool = True) -> dict[int, float] | str:
    """GB/s of a ucxx channel alone, checksummed like the KV protocol (xxh3-64 over every
    frame on both ends; `checksums=False`: none) but without the protocol: what the backend
    could reach at best once it verifies every byte. Two processes, one unit buffer per side
    reused (as perftest's). Why it could not run, if it could not (the table goes on)."""
    out: dict[int, float] = {}
    flags = [] if checksums else ["--no-hash"]
    for size in sizes:
        count = str(count_for(size, budget) + 1)
        try:
            receiver = Peer(["chan", "--nbytes", str(size), "--count", count, *flags], env)
        except RuntimeError as e:
            return f"channel reference failed: {e}"
        try:
            sender = Peer(["chansend", "--address", receiver.first["address"], "--nbytes", str(size),
                           "--count", count, *flags], env)
            out[size] = sender.first["gbps"]
            sender.close()
        except RuntimeError as e:
            return f"channel reference failed: {e}"
        finally:
            receiver.close()
    return out


def perftest_throughput(tls: str, sizes: Sequence[int], rounds: int,
                        error_handling: bool = True) -> dict[int, float] | str:
    """GB/s of `ucx_perftest -t tag_bw` with UCX_TLS=tls (best of `rounds`), or why it could not
    run. `error_handling`: endpoints with peer error handling and the backend's UCX settings
    (like for like with the ucxx backend), else perftest's defaults plus the loopback tuning."""
    exe, libdir = find_perftest()
    if exe is None:
        return "ucx_perftest not found (it ships in the libucx-cu12 wheel, or apt-get install ucx-utils)"
    out: dict[int, float] = {}
    for size in sizes:
        for _ in range(rounds):
            rate = _perftest_once(exe, libdir, tls, size, count_for(size, 2 << 30), error_handling)
            if isinstance(rate, str):
                return rate
            out[size] = max(out.get(size, 0.0), rate)
    return out


def find_perftest() -> tuple[str | None, str | None]:
    """(ucx_perftest, the lib dir it needs): the one in the libucx wheel (same UCX as ucxx),
    else the system's."""
    try:
        import libucx

        root = os.path.dirname(libucx.__file__)
        exe = os.path.join(root, "bin", "ucx_perftest")
        if os.access(exe, os.X_OK):
            return exe, os.path.join(root, "lib")
    except ImportError:
        pass  # no wheel: try the system's below
    return shutil.which("ucx_perftest"), None


def _perftest_once(exe: str, libdir: str | None, tls: str, size: int, iters: int,
                   error_handling: bool) -> float | str:
    from halfmoon.transport.ucxx_backend import UCX_ENV_DEFAULTS

    settings = {**UCX_ENV_DEFAULTS, **UCX_LOOPBACK_ENV} if error_handling else UCX_LOOPBACK_ENV
    env = {**os.environ, **settings, "UCX_TLS": tls}
    if libdir is not None:
        env["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, os.environ.get("LD_LIBRARY_PATH")) if p)
    port = _free_port()
    args = ["-t", "tag_bw", "-s", str(size), "-n", str(iters), "-w", "2", "-p", str(port)]
    args += ["-e"] if error_handling else []
    server = subprocess.Popen([exe, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        client = subprocess.run([exe, "127.0.0.1", *args], env=env, capture_output=True, text=True, timeout=120)
    finally:
        server.kill()
        server.wait()
    return parse_perftest(client.stdout) if client.returncode == 0 else f"ucx_perftest failed: {client.stderr[-300:]}"


def parse_perftest(text: str) -> float | str:
    """The final summary line's average bandwidth (MB/s column) as GB/s."""
    rows = [line.split() for line in text.splitlines() if line.strip().startswith("Final:")]
    if not rows:
        return "no Final: line in ucx_perftest output"
    # Final: iters  typical-lat avg-lat overall-lat  avg-bw(MB/s) overall-bw(MB/s)  msgrate...
    return float(rows[-1][6]) * MB / 1e9


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- 2. layer pipelining


def pipelining(lengths: Sequence[int], backend: str, threads: int, repeats: int,
               progress: Progress, device: str = "cpu", dtype: str = "float32") -> list[dict[str, Any]]:
    """The pipelining rows; `device` cuda: the prefill engine on the GPU, its units leaving through
    pinned staging slots (transport/staging.py; `path` in each row) to a host receiver."""
    from halfmoon.engine.config import EngineConfig
    from halfmoon.engine.engine import Engine
    from halfmoon.transport import KVSender, get_backend

    blocks_max = cdiv(max(lengths), 16) + 1
    engine = Engine(EngineConfig(model="smollm2", dtype=dtype, num_threads=threads, num_blocks=blocks_max,
                                 device=device, cuda_graphs=False))
    kv = engine.kv_cache
    layout = engine.kv_layout()
    peer = Peer(["kv", "--backend", backend, "--shape", ",".join(map(str, kv.shape)),
                 "--fingerprint", layout.fingerprint])
    sender = KVSender(kv, layout, get_backend(backend), peer.first["address"], timeout=120.0)
    try:
        rows = []
        for n in lengths:
            progress(f"pipelining: {n}-token prompt ({repeats} repeats of prefill / pipelined / transfer)")
            rows.append({**_pipeline_row(engine, sender, peer, n, repeats), "path": sender.path})
        return rows
    finally:
        sender.close()
        peer.close()


def _pipeline_row(engine, sender, peer: Peer, n: int, repeats: int) -> dict[str, float]:  # noqa: ANN001
    gen = torch.Generator().manual_seed(n)
    prompt = torch.randint(0, engine.model_config.vocab_size, (n,), generator=gen).tolist()
    blocks = list(range(cdiv(n, 16)))
    prefill = transfer = exposed = float("inf")
    pipelined = (float("inf"), 0.0)
    for r in range(repeats):  # a fresh cache salt each run: no prefix-cache hit between runs
        prefill = min(prefill, _prefill(engine, prompt, f"p{n}-{r}", None))
        run = _pipelined(engine, sender, peer, prompt, blocks, f"q{n}-{r}")
        pipelined, exposed = min(pipelined, run), min(exposed, run[1])
        transfer = min(transfer, _transfer(engine, sender, peer, blocks, f"t{n}-{r}"))
    return {"tokens": n, "kv_mb": len(blocks) * engine.kv_cache[:, :, 0].nbytes / MB,
            "prefill_ms": prefill * 1e3, "transfer_ms": transfer * 1e3, "after_ms": (prefill + transfer) * 1e3,
            "pipelined_ms": pipelined[0] * 1e3, "exposed_ms": exposed * 1e3, "hidden": 1 - exposed / transfer}


def _prefill(engine, prompt: list[int], salt: str, stream) -> float:  # noqa: ANN001
    """Seconds until the prefill's last forward pass returned (first token sampled)."""
    from halfmoon.core.params import SamplingParams

    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0), cache_salt=salt, kv_push=stream)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def _pipelined(engine, sender, peer: Peer, prompt: list[int], blocks: list[int], rid: str) -> tuple[float, float]:  # noqa: ANN001
    """(prefill start -> decode side ready, compute end -> ready) in seconds."""
    peer.ask(op="expect", rids=[rid], blocks=blocks)
    start = time.perf_counter()
    stream = sender.open(rid, blocks)
    _prefill(engine, prompt, rid, stream)
    computed = time.perf_counter()
    stream.wait(300)
    ready = time.perf_counter()
    engine.step()  # releases the held blocks
    return ready - start, ready - computed


def _transfer(engine, sender, peer: Peer, blocks: list[int], rid: str) -> float:  # noqa: ANN001
    """Every layer of the prompt's blocks, sent after the prefill (the baseline's second half)."""
    peer.ask(op="expect", rids=[rid], blocks=blocks)
    start = time.perf_counter()
    stream = sender.open(rid, blocks)
    for layer in range(engine.kv_cache.shape[0]):
        stream.send_layer(layer, blocks, blocks)
    stream.finish({"first_token": 0})
    stream.wait(300)
    return time.perf_counter() - start


# ---------------------------------------------------------------- report


THROUGHPUT_NOTE = (
    "ucxx baseline: ucx_perftest -e (endpoints with peer error handling, as the backend's) "
    "and the backend's UCX settings; no-EH raw: ucx_perftest without -e (CMA zero-copy on one host); "
    "chan: a ucxx channel alone (the backend's, no KV protocol, no checksums); chan+xxh3: the same with "
    "the protocol's checksums (xxh3-64 of every frame on both ends): the ceiling for a verified "
    "transfer; their ratios are to perftest -e; "
    "ratio and target: best of the rounds on each side; rounds: each round's own ratio")


def throughput_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'backend':<22}{'size':>8}{'halfmoon GB/s':>15}{'raw GB/s':>10}  {'baseline':<30}{'ratio':>7}"
            f"  {'target':<15}{'no-EH raw':>10}{'ratio':>7}{'chan':>7}{'ratio':>7}{'chan+xxh3':>10}{'ratio':>7}"
            "  rounds (backend / raw, back to back)")
    return ruled(head, [*map(_throughput_row, rows), THROUGHPUT_NOTE])


def _throughput_row(r: dict[str, Any]) -> str:
    ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
    raw = "-" if r["raw_gbps"] is None else f"{r['raw_gbps']:.2f}"
    target = "" if r["target"] is None else (">=0.70x " + ("met" if r["met"] else "MISSED"))
    plain = r.get("plain_gbps")
    extra = f"{'-':>10}{'-':>7}" if plain is None else f"{plain:>10.2f}{r['gbps'] / plain:>6.2f}x"
    bare, chan = r.get("bare_channel_gbps"), r.get("channel_gbps")
    if bare is not None and chan is not None and r["raw_gbps"]:
        extra += f"{bare:>7.2f}{bare / r['raw_gbps']:>6.2f}x{chan:>10.2f}{chan / r['raw_gbps']:>6.2f}x"
    if r.get("round_ratios"):
        extra += "  " + " ".join(f"{x:.2f}" for x in r["round_ratios"])
    return (f"{r['backend']:<22}{r['size_mb']:>6}MB{r['gbps']:>15.2f}{raw:>10}  {r['baseline']:<30}"
            f"{ratio:>7}  {target:<15}{extra}")


def pipeline_table(rows: list[dict[str, float]]) -> str:
    head = (f"{'tokens':>7}{'KV MB':>8}{'prefill ms':>12}{'transfer ms':>13}{'after ms':>10}"
            f"{'pipelined ms':>14}{'exposed ms':>12}{'hidden':>9}  target")
    return ruled(head, map(_pipeline_row, rows))


def _pipeline_row(r: dict[str, float]) -> str:
    target = (">=80% " + ("met" if r["hidden"] >= 0.8 else "MISSED")) if r["tokens"] == 2048 else ""
    return (f"{r['tokens']:>7}{r['kv_mb']:>8.0f}{r['prefill_ms']:>12.0f}{r['transfer_ms']:>13.0f}"
            f"{r['after_ms']:>10.0f}{r['pipelined_ms']:>14.0f}{r['exposed_ms']:>12.1f}"
            f"{r['hidden']:>8.0%}  {target}")


def throughput_rows(backends: Sequence[str], sizes: Sequence[int], tls_list: Sequence[str],
                    budget: int, rounds: int, progress: Progress) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if "tcp" in backends:
        progress("throughput: raw Python sockets")
        raw = socket_throughput(sizes, budget, rounds)
        progress("throughput: tcp backend")
        got = kv_throughput("tcp", sizes, budget, None, rounds)
        rows += [_row("tcp", s, got[s], raw[s], "python sockets") for s in sizes]
    for tls in tls_list if "ucxx" in backends else ():
        got, raw_ucx, plain, chan, bare, paired = _ucxx_rounds(tls, sizes, budget, rounds, progress)
        for s in sizes:
            base = None if isinstance(raw_ucx, str) else raw_ucx[s]
            label = f"ucx_perftest -e {tls}" if base else "ucx_perftest unavailable"
            row = _row(f"ucxx ({tls})", s, got[s], base, label)
            row["plain_gbps"] = None if isinstance(plain, str) else plain[s]
            row["channel_gbps"] = None if isinstance(chan, str) else chan[s]
            row["bare_channel_gbps"] = None if isinstance(bare, str) else bare[s]
            row["round_ratios"] = paired.get(s, [])
            rows.append(row)
    return rows


def _ucxx_rounds(tls: str, sizes: Sequence[int], budget: int, rounds: int, progress: Progress
                 ) -> tuple[dict[int, float], dict[int, float] | str, dict[int, float] | str,
                            dict[int, float] | str, dict[int, float] | str, dict[int, list[float]]]:
    """Best of `rounds` for the backend, perftest -e, plain perftest and the channel alone
    (channel_throughput) with and without checksums, taking turns; and per size the ratio
    backend / perftest -e of each round (the two measured back to back)."""
    env = {**UCX_LOOPBACK_ENV, "UCX_TLS": tls}
    got: dict[int, float] = {}
    raw: dict[int, float] | str = {}
    plain: dict[int, float] | str = {}
    chan: dict[int, float] | str = {}
    bare: dict[int, float] | str = {}
    paired: dict[int, list[float]] = {}
    for r in range(rounds):
        progress(f"throughput: UCX_TLS={tls}, round {r + 1}/{rounds}: ucx_perftest -e, ucx_perftest, "
                 "channel with and without checksums, ucxx backend")
        raw_r = perftest_throughput(tls, sizes, 1, error_handling=True)
        plain = _best(plain, perftest_throughput(tls, sizes, 1, error_handling=False))
        chan = _best(chan, channel_throughput(sizes, budget, env))
        bare = _best(bare, channel_throughput(sizes, budget, env, checksums=False))
        got_r = kv_throughput("ucxx", sizes, budget, env, 1)
        raw, got = _best(raw, raw_r), _best(got, got_r)  # type: ignore[assignment]
        if not isinstance(raw_r, str):
            for s in sizes:
                paired.setdefault(s, []).append(got_r[s] / raw_r[s])
    if isinstance(raw, str):
        progress(f"  baseline unavailable: {raw}")
    return got, raw, plain, chan, bare, paired


def _best(acc: dict[int, float] | str, new: dict[int, float] | str) -> dict[int, float] | str:
    """Per-size maximum of two results; an error message (str) sticks."""
    if isinstance(acc, str) or isinstance(new, str):
        return acc if isinstance(acc, str) else new
    return {s: max(acc.get(s, 0.0), rate) for s, rate in new.items()}


def _row(backend: str, size: int, gbps: float, raw: float | None, baseline: str) -> dict[str, Any]:
    ratio = None if raw is None else gbps / raw
    target = 0.70 if size >= 8 * MB and ratio is not None else None
    return {"backend": backend, "size_mb": size // MB, "gbps": gbps, "raw_gbps": raw, "baseline": baseline,
            "ratio": ratio, "target": target, "met": None if target is None else ratio >= target}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="halfmoon bench transport", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="tcp,ucxx", help="comma-separated: tcp, ucxx")
    p.add_argument("--sizes-mb", default="1,8,64,256", help="transfer unit sizes for the throughput part")
    p.add_argument("--ucx-tls", default=";".join(UCX_TLS_DEFAULT),
                   help="UCX_TLS values to run ucxx with, separated by ';' (default: %(default)s)")
    p.add_argument("--budget-mb", type=int, default=512, help="bytes moved per round of a throughput point")
    p.add_argument("--rounds", type=int, default=3, help="rounds per throughput point (best is reported: "
                   "the machine is noisy)")
    p.add_argument("--lengths", default="512,2048,8191", help="prompt lengths for the pipelining part")
    p.add_argument("--pipeline-backend", default="tcp", help="backend for the pipelining part")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the prefill engine "
                   "(default 1: the sender thread and the receiver process need the other core)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip", choices=["throughput", "pipelining"], action="append", default=[])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="the pipelining part's prefill engine (cuda: bf16, units staged through pinned slots)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    progress = Progress()
    backends = [b for b in args.backends.split(",") if b]
    sizes = [int(s) * MB for s in args.sizes_mb.split(",")]
    tls_list = [t for t in args.ucx_tls.split(";") if t]
    report: dict[str, Any] = {"date": utc_now(), "machine": machine_info(args.threads)}
    if "throughput" not in args.skip:
        report["throughput"] = throughput_rows(backends, sizes, tls_list, args.budget_mb * MB, args.rounds, progress)
    if "pipelining" not in args.skip:
        lengths = [int(n) for n in args.lengths.split(",")]
        report["pipelining"] = pipelining(lengths, args.pipeline_backend, args.threads, args.repeats, progress,
                                          args.device, "bfloat16" if args.device == "cuda" else "float32")
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if "throughput" in report:
        print(throughput_table(report["throughput"]))
    if "pipelining" in report:
        print(pipeline_table(report["pipelining"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
