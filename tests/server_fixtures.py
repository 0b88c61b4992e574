"""The API servers every test directory shares (a plugin of tests/conftest.py): `api`, one
session-wide server over its own engine, and `start_api(**config)` for servers of a module's own
(auth, TLS, limits), stopped when that module ends so their engines do not pile up in the
suite's one process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from halfmoon.api.server import ServerConfig
from halfmoon.conductor.admission import AdmissionConfig
from halfmoon.conductor.colocated import ColocatedBackend
from tests.conductor.conftest import CLIENT_SLOS_ONLY, MODEL, RunningApi, run_api
from tests.conftest import EngineFactory


def _start(make_engine: EngineFactory, num_blocks: int = 256, max_waiting: int = 256,
           admission: AdmissionConfig = CLIENT_SLOS_ONLY, **config: Any) -> RunningApi:
    engine = make_engine(num_blocks=num_blocks)
    backend = ColocatedBackend(engine, MODEL, max_waiting=max_waiting, admission=admission)
    return run_api(backend, ServerConfig(**{"grpc_port": 0, "http_port": 0, **config}))


@pytest.fixture(scope="module")
def start_api(make_engine: EngineFactory) -> Iterator[Callable[..., RunningApi]]:
    """`start_api(num_blocks=..., max_waiting=..., admission=..., **ServerConfig fields)` -> a
    running server, stopped at the module's end. Admission: only the SLOs a request sends (the
    API tests are not about load)."""
    running: list[RunningApi] = []

    def start(**config: Any) -> RunningApi:
        api = _start(make_engine, **config)
        running.append(api)
        return api

    yield start
    for api in running:
        api.stop()
    running.clear()


@pytest.fixture(scope="session")
def shared_api(make_engine: EngineFactory) -> Iterator[RunningApi]:
    api = _start(make_engine)
    yield api
    api.stop()


@pytest.fixture
def api(shared_api: RunningApi) -> Iterator[RunningApi]:
    """The session's server; the test must leave its engine idle with every block free."""
    problems = shared_api.wait_idle()
    assert not problems, "; ".join(problems)
    yield shared_api
    problems = shared_api.wait_idle()
    assert not problems, "the test left the server busy: " + "; ".join(problems)
