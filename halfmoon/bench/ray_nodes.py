"""A multi-node Ray cluster on this machine: a head and more raylets, each a real Ray node with its
own node id and custom resources, started with the `ray` CLI as an operator would start them on
separate machines (`ray start --head`, then `ray start --address ...` per node).

`halfmoon bench serve --nodes N` and the multi-node tests use it, then point
`halfmoon serve --ray-address` (or `ClusterConfig.ray_address`) at `address`:

    with LocalRayNodes([{"prefill": 1, "decode": 1}, {"prefill": 1}], Path("/tmp/hm-ray")) as nodes:
        ... halfmoon serve --ray-address {nodes.address} --prefill 2 --decode 1 ...

Every port a raylet would take by default (52365 for the dashboard agent, 10001 for Ray Client,
...) is a free one of its own, so the nodes collide neither with each other nor with another Ray
on the machine. `stop` ends exactly the processes these `ray start` commands started (their
process trees, by pid), never another Ray's (`ray stop` would end every Ray of the user).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import psutil

HEAD_WAIT_S = 120.0  # the GCS of a loaded 2-core machine can take a while
STOP_WAIT_S = 10.0  # then SIGKILL: a head's `ray start --block` may outwait its SIGTERM
PAUSE_WAIT_S = 10.0  # a paused node: every process of it reports stopped within this
# The per-node ports `ray start` would otherwise take at fixed defaults (or share).
PORT_FLAGS = ("--node-manager-port", "--object-manager-port", "--metrics-export-port",
              "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port")


class RayNodesError(RuntimeError):
    """A node did not come up (the message quotes the end of its log)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_cli() -> str:
    """The `ray` command of this interpreter's environment (then PATH's)."""
    beside = Path(sys.executable).parent / "ray"
    found = str(beside) if beside.is_file() else shutil.which("ray")
    if found is None:
        raise RayNodesError("no `ray` command beside this Python or on PATH: install ray")
    return found


class LocalRayNodes:
    """Ray nodes on this machine: `resources[0]` for the head, one more raylet per later entry.

    num_cpus: CPUs each node advertises (a worker actor takes `--worker-threads` of them).
    object_store_mb: each node's object store (Ray takes 30% of RAM otherwise).
    """

    def __init__(self, resources: Sequence[Mapping[str, float]], temp_dir: Path, num_cpus: int = 2,
                 object_store_mb: int = 80) -> None:
        if not resources:
            raise ValueError("LocalRayNodes needs at least the head's resources")
        self.resources = [dict(r) for r in resources]
        self.temp_dir, self.num_cpus, self.object_store_mb = temp_dir, num_cpus, object_store_mb
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stopped: list[psutil.Process] = []  # every process of the nodes when `stop` began
        self.logs: list[Path] = []

    def __enter__(self) -> LocalRayNodes:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> LocalRayNodes:
        """Start the head, wait for its GCS, then start the other raylets (which register with
        it by themselves; `halfmoon serve` waits for their resources)."""
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start_node(0, ["--head", f"--port={self.port}", f"--temp-dir={self.temp_dir}",
                                 "--include-dashboard=false", f"--ray-client-server-port={free_port()}"])
            self._await_gcs()
            for i in range(1, len(self.resources)):
                self._start_node(i, [f"--address={self.address}"])
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self, i: int, role_flags: list[str]) -> None:
        log = self.temp_dir / f"node-{i}.log"
        ports = [f"{flag}={free_port()}" for flag in PORT_FLAGS]
        command = [ray_cli(), "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1",
                   f"--num-cpus={self.num_cpus}", f"--object-store-memory={self.object_store_mb * 2**20}",
                   f"--resources={json.dumps(self.resources[i])}", *ports, *role_flags]
        with log.open("wb") as out:
            self.procs.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=node_env(),
                                               start_new_session=True))
        self.logs.append(log)

    def _await_gcs(self) -> None:
        deadline = time.monotonic() + HEAD_WAIT_S
        while time.monotonic() < deadline:
            if self.procs[0].poll() is not None:
                raise RayNodesError(f"the Ray head exited ({self.procs[0].returncode}): {self._tail(0)}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                    return
            except OSError:
                time.sleep(0.2)  # the head's GCS is not listening yet
        raise RayNodesError(f"the Ray head's GCS did not listen on {self.address} within {HEAD_WAIT_S:g} s: "
                            f"{self._tail(0)}")

    def _tail(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        """End every process each `ray start` started: SIGTERM to its process group (the
        command then stops its node), then SIGKILL to whatever of its tree is left."""
        trees = [_tree(p.pid) for p in self.procs]
        self.stopped = [proc for tree in trees for proc in tree]
        for proc in reversed(self.procs):  # the other raylets first, the head last
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT_S
        for proc, tree in zip(self.procs, trees):
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(STOP_WAIT_S)
            _kill_left(tree + _tree(proc.pid))
        self.procs.clear()

    def pause_node(self, i: int, timeout_s: float = PAUSE_WAIT_S) -> None:
        """SIGSTOP every process of node `i` (a hung machine: connections open, nothing answers)
        and return once each one is stopped. By process tree, not group: the raylet starts its
        workers in process groups of their own; a process it forked while the others were being
        stopped is stopped on the next pass (a signal is not delivered at once, so the tree is
        read again until all of it reports stopped)."""
        deadline = time.monotonic() + timeout_s
        while running := [p for p in _tree(self.procs[i].pid) if _state(p) not in _PAUSED]:
            if time.monotonic() > deadline:
                raise RayNodesError(f"node {i}: {len(running)} processes still running {timeout_s:g} s after SIGSTOP")
            for proc in running:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.suspend()
            time.sleep(0.02)  # the kernel delivers the signals

    def kill_node(self, i: int) -> list[psutil.Process]:
        """SIGKILL every process of node `i` (a machine lost); returns them, all gone."""
        proc = self.procs[i]
        tree = _tree(proc.pid)
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait(STOP_WAIT_S)
        _kill_left(tree)
        return tree

    def node_processes(self, i: int) -> list[psutil.Process]:
        """Node `i`'s processes now: its `ray start` and everything it started."""
        return _tree(self.procs[i].pid)

    def leftovers(self) -> list[int]:
        """Pids still alive of the processes the nodes had when `stop` began (empty after it)."""
        return [p.pid for p in self.stopped if is_alive(p)]


_PAUSED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def _state(proc: psutil.Process) -> str:
    try:
        return proc.status()
    except psutil.NoSuchProcess:
        return psutil.STATUS_DEAD


def node_env() -> dict[str, str]:
    """The environment of a node's processes (Ray's actors inherit it): no Ray token auth, no
    usage reports, a patient GCS wait."""
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_gcs_server_port_wait_time_s": "120"}


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)  # the group of a `ray start` we started (start_new_session)
    except ProcessLookupError:
        pass


def is_alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_left(tree: list[psutil.Process]) -> None:
    for proc in tree:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
