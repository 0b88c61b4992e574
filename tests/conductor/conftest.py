"""A real front door (gRPC + HTTP on loopback) over a real co-located engine, in this process.

`api` is one session-wide server on free ports; `start_api(**config)` starts others (auth, TLS,
small limits) for a test. The server runs its event loop on its own thread, like `halfmoon
serve` does on its main thread; the engine steps on the backend's thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from conductor.colocated import ColocatedBackend
from conductor.server import Endpoints, ServerConfig, serve
from engine.engine import Engine
from tests.conftest import EngineFactory, idle_problems
from tests.waiting import poll

MODEL = "smollm2"


@dataclass
class RunningApi:
    backend: ColocatedBackend
    endpoints: Endpoints
    stop: Callable[[], None]

    @property
    def engine(self) -> Engine:
        return self.backend.engine

    @property
    def grpc_target(self) -> str:
        return self.endpoints.grpc_target

    @property
    def http_url(self) -> str:
        return self.endpoints.http_url

    def wait_idle(self, timeout: float = 10.0) -> list[str]:
        """Problems left once the engine had `timeout` s to settle (aborts take one step)."""

        def problems() -> list[str]:
            found = idle_problems(self.engine)
            if self.backend.stats().requests_running + self.backend.stats().requests_waiting:
                found.append("backend still tracks requests")
            return found

        return [] if poll(lambda: not problems(), timeout) else problems()


def run_api(backend: ColocatedBackend, config: ServerConfig) -> RunningApi:
    ready: list[Endpoints] = []
    failure: list[BaseException] = []
    started = threading.Event()
    holder: dict[str, Any] = {}

    async def main() -> None:
        holder["loop"] = asyncio.get_running_loop()
        holder["stop"] = stop = asyncio.Event()

        def announce(ep: Endpoints) -> None:
            ready.append(ep)
            started.set()

        await serve(backend, config, stop, announce)

    def thread_main() -> None:
        try:
            asyncio.run(main())
        except BaseException as e:  # surfaced to the test below
            failure.append(e)
            started.set()

    thread = threading.Thread(target=thread_main, name="api-server", daemon=True)
    thread.start()
    started.wait(60)
    if failure:
        raise failure[0]
    assert ready, "the server did not come up in 60 s"

    def stop() -> None:
        holder["loop"].call_soon_threadsafe(holder["stop"].set)
        thread.join(30)
        assert not thread.is_alive(), "the server did not stop in 30 s"

    return RunningApi(backend, ready[0], stop)


@pytest.fixture(scope="session")
def start_api(make_engine: EngineFactory) -> Iterator[Callable[..., RunningApi]]:
    """`start_api(num_blocks=..., max_waiting=..., **ServerConfig fields)` -> a running server."""
    running: list[RunningApi] = []

    def start(num_blocks: int = 256, max_waiting: int = 256, **config: Any) -> RunningApi:
        engine = make_engine(num_blocks=num_blocks)
        backend = ColocatedBackend(engine, MODEL, max_waiting=max_waiting)
        api = run_api(backend, ServerConfig(**{"grpc_port": 0, "http_port": 0, **config}))
        running.append(api)
        return api

    yield start
    for api in running:
        api.stop()


@pytest.fixture(scope="session")
def shared_api(start_api: Callable[..., RunningApi]) -> RunningApi:
    return start_api()


@pytest.fixture
def api(shared_api: RunningApi) -> Iterator[RunningApi]:
    """The session's server; the test must leave its engine idle with every block free."""
    problems = shared_api.wait_idle()
    assert not problems, "; ".join(problems)
    yield shared_api
    problems = shared_api.wait_idle()
    assert not problems, "the test left the server busy: " + "; ".join(problems)
