"""The soak's faults: a seeded schedule and each fault kind as a real act on the running cluster.

Kinds (`KINDS`):

- `kill-prefill` / `kill-decode`: kill -9 of the serving prefill worker's process / of one decode
  worker's (picked by the seed); recovered when the Conductor's view has that worker alive again in
  a new process (Ray's restart) — the restart-to-serving time.
- `kill-redis`: kill -9 of the embedded redis-server; recovered when a new one runs (`halfmoon
  serve`'s supervisor) and `/health` is `ok` again (the index re-synced).
- `sigstop`: SIGSTOP of one worker for `STOP_S` (longer than the cluster index's heartbeat TTL,
  10 s), then SIGCONT; recovered when the worker is alive and `/health` is `ok`.
- `kv-drop`: every KV connection of the prefill worker closed (its drill verb, through Ray).
- `enospc`: the disk tier's directory (a small tmpfs mounted by the soak) filled to ENOSPC with a
  ballast file for `ENOSPC_S`, then the ballast removed.
- `slow`: one decode worker's steps made slow for `SLOW_S`: SIGSTOP / SIGCONT duty cycling of its
  process (`SLOW_DUTY_S` stopped, the same running) — the kernel's mechanism, no hook in the worker.

Faults strike one at a time; a fault whose time comes while the previous one still recovers waits
(its delay is recorded). Every fault is recorded with its start, end and recovery time.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("kill-prefill", "kill-decode", "kill-redis", "sigstop", "kv-drop", "enospc", "slow")
STOP_S = 12.0  # > the cluster index's heartbeat TTL (kvpool/index_link.py: 10 s)
ENOSPC_S = 8.0
SLOW_S = 8.0
SLOW_DUTY_S = 0.25
RECOVERY_TIMEOUT_S = 180.0


@dataclass
class Fault:
    """One fault of the schedule and, once struck, what happened."""

    at_s: float  # scheduled, seconds after the load started
    kind: str
    target: str = ""
    struck_s: float | None = None  # when it actually struck (a previous fault's recovery may delay it)
    ended_s: float | None = None  # the fault lifted (SIGCONT, ballast removed; a kill: at once)
    recovered_s: float | None = None  # serving again (None: not recovered within the timeout)
    note: str = ""

    @property
    def restart_to_serving_s(self) -> float | None:
        if self.recovered_s is None or self.struck_s is None:
            return None
        return round(self.recovered_s - self.struck_s, 3)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "at_s": round(self.at_s, 2), "target": self.target,
                "struck_s": _r(self.struck_s), "ended_s": _r(self.ended_s), "recovered_s": _r(self.recovered_s),
                "restart_to_serving_s": self.restart_to_serving_s, "note": self.note}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def per_kind(minutes: float) -> int:
    """Faults of each kind in a run of `minutes`: 12 in 30 minutes (the must-hold), at least 1."""
    return max(1, round(minutes * 12.5 / 30))


def schedule(kinds: tuple[str, ...], minutes: float, seed: int, warm_up_s: float) -> list[Fault]:
    """Each kind `per_kind(minutes)` times, shuffled by `seed`, one per equal slot of the run
    after `warm_up_s` (and before its last 10%), at a seeded random time within its slot."""
    if not kinds:
        return []
    rng = random.Random(seed)
    order = [k for k in kinds for _ in range(per_kind(minutes))]
    rng.shuffle(order)
    start, end = warm_up_s, minutes * 60 * 0.9
    slot = max(end - start, 1.0) / len(order)
    return [Fault(start + i * slot + rng.uniform(0, slot * 0.5), kind) for i, kind in enumerate(order)]


@dataclass
class Cluster:
    """What the faults act on: the server (bench.chaos_bench.Server), the disk tier's directory
    (None: no enospc), the seed's random choices, and the clock the run measures with."""

    server: Any
    disk_dir: Path | None
    rng: random.Random
    t0: float
    ray_ready: bool = False
    ballast_bytes: list[int] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def workers(self, role: str) -> list[dict[str, Any]]:
        return [w for w in self.server.live()["workers"] if w["role"] == role and w["state"] in ("ready", "promoting")]

    def actor(self, worker_id: str) -> Any:
        import ray

        if not self.ray_ready:
            ray.init(address="auto", namespace="halfmoon", log_to_driver=False)
            self.ray_ready = True
        return ray.get_actor(worker_id, namespace="halfmoon")

    def close(self) -> None:
        """Disconnect this process from the cluster's Ray (a test process outlives the cluster)."""
        if self.ray_ready:
            import ray

            ray.shutdown()
            self.ray_ready = False


def strike(cluster: Cluster, fault: Fault) -> None:
    """Strike `fault` now, lift it, and wait until the cluster serves again (recorded on it)."""
    fault.struck_s = cluster.now()
    try:
        ACTS[fault.kind](cluster, fault)
    except Exception as e:  # recorded: a fault that could not be struck is a finding, not a crash
        fault.note = f"strike failed: {type(e).__name__}: {e}"
    if fault.ended_s is None:
        fault.ended_s = cluster.now()


def _kill_worker(role: str) -> Callable[[Cluster, Fault], None]:
    def act(cluster: Cluster, fault: Fault) -> None:
        victim = cluster.rng.choice(cluster.workers(role))
        fault.target = victim["id"]
        os.kill(victim["pid"], signal.SIGKILL)
        fault.ended_s = cluster.now()
        _await(cluster, fault, lambda: _back(cluster, victim["id"], victim["pid"]))
    return act


def _back(cluster: Cluster, worker_id: str, old_pid: int) -> bool:
    w = next((w for w in cluster.server.live()["workers"] if w["id"] == worker_id), None)
    return w is not None and w["alive"] and w["pid"] != old_pid and w["state"] == "ready"


def _kill_redis(cluster: Cluster, fault: Fault) -> None:
    from halfmoon.bench.chaos_bench import _redis_marker

    pid = cluster.server.pid_of(_redis_marker())
    fault.target = f"redis-server pid {pid}"
    os.kill(pid, signal.SIGKILL)
    fault.ended_s = cluster.now()

    def back() -> bool:
        try:
            again = cluster.server.pid_of(_redis_marker()) != pid
        except RuntimeError:  # not restarted yet
            return False
        return again and cluster.server.health().get("status") == "ok"

    _await(cluster, fault, back)


def _sigstop(cluster: Cluster, fault: Fault) -> None:
    victim = cluster.rng.choice(cluster.workers("prefill") + cluster.workers("decode"))
    fault.target = victim["id"]
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        time.sleep(STOP_S)  # the fault's length: stopped longer than the heartbeat TTL
    finally:
        _cont(victim["pid"])
    fault.ended_s = cluster.now()
    _await(cluster, fault, lambda: _healthy_with(cluster, victim["id"]))


def _healthy_with(cluster: Cluster, worker_id: str) -> bool:
    live = cluster.server.live()["workers"]
    alive = any(w["id"] == worker_id and w["alive"] for w in live)
    return alive and cluster.server.health().get("status") == "ok"


def _cont(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:  # it died while stopped (the Conductor or Ray restarted it)
        pass


def _kv_drop(cluster: Cluster, fault: Fault) -> None:
    import ray

    victim = cluster.workers("prefill")[0]
    fault.target = victim["id"]
    n = ray.get(cluster.actor(victim["id"]).drop_kv_connections.remote(), timeout=30)
    fault.note = f"{n} connections dropped"
    fault.ended_s = fault.recovered_s = cluster.now()


def _enospc(cluster: Cluster, fault: Fault) -> None:
    assert cluster.disk_dir is not None, "enospc needs the soak's tmpfs"
    ballast = cluster.disk_dir / "soak-ballast"
    fault.target = str(cluster.disk_dir)
    written = fill(ballast)
    cluster.ballast_bytes.append(written)
    fault.note = f"ballast {written / 2**20:.1f} MiB to ENOSPC"
    try:
        time.sleep(ENOSPC_S)  # the fault's length: the disk tier's writes meet ENOSPC meanwhile
    finally:
        ballast.unlink()
    fault.ended_s = fault.recovered_s = cluster.now()


def fill(path: Path, chunk: int = 1 << 20) -> int:
    """Write zeros to `path` until the filesystem says ENOSPC; the bytes written. Any other
    error raises; a filesystem that never fills (more than 1 TiB) raises too."""
    written, block = 0, b"\1" * chunk
    with open(path, "wb", buffering=0) as f:
        while written < 1 << 40:
            try:
                written += f.write(block)
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
                if chunk > 4096:  # fill the last pages too
                    chunk //= 16
                    block = block[:chunk]
                    continue
                return written
    raise RuntimeError(f"{path.parent} did not fill up after 1 TiB: not the soak's small tmpfs")


def _slow(cluster: Cluster, fault: Fault) -> None:
    victim = cluster.rng.choice(cluster.workers("decode"))
    fault.target = victim["id"]
    end = time.monotonic() + SLOW_S
    try:
        while time.monotonic() < end:
            os.kill(victim["pid"], signal.SIGSTOP)
            time.sleep(SLOW_DUTY_S)  # the duty cycle: stopped
            _cont(victim["pid"])
            time.sleep(SLOW_DUTY_S)  # running
    except ProcessLookupError:
        fault.note = "the worker died while slowed"
    finally:
        _cont(victim["pid"])
    fault.ended_s = fault.recovered_s = cluster.now()


def _await(cluster: Cluster, fault: Fault, back: Callable[[], bool]) -> None:
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if back():
                fault.recovered_s = cluster.now()
                return
        except OSError:  # the Conductor's HTTP port busy or refusing for a moment: poll again
            pass
        time.sleep(0.1)  # polling the Conductor's own view of its workers
    fault.note = f"not serving again within {RECOVERY_TIMEOUT_S:g} s"


ACTS: dict[str, Callable[[Cluster, Fault], None]] = {
    "kill-prefill": _kill_worker("prefill"), "kill-decode": _kill_worker("decode"), "kill-redis": _kill_redis,
    "sigstop": _sigstop, "kv-drop": _kv_drop, "enospc": _enospc, "slow": _slow}


def mount_tmpfs(path: Path, mib: int) -> str | None:
    """Mount a `mib` MiB tmpfs at `path` (root only); None, or why it could not (said loudly by
    the caller, and enospc is then excluded)."""
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "not root: cannot mount a tmpfs for the disk tier"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)],
                          capture_output=True, text=True)
    return None if done.returncode == 0 else f"mount -t tmpfs failed: {done.stderr.strip()}"


def unmount(path: Path) -> None:
    import subprocess

    subprocess.run(["umount", "-l", str(path)], capture_output=True)
