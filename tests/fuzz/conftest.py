"""The fuzzers' target: a real front door (gRPC + HTTP with the dashboard, bearer auth on) over a
real co-located SmolLM2 engine, with limits small enough that every generation is quick. The
token opens the admin API too, and `fuzz_adapter` is a LoRA adapter it can serve: the folder the
fuzzers' valid loads name (a random path is never a PEFT folder, so it is only ever refused).

`FUZZ` is the run's size: the normal suite runs a short seeded pass; `make fuzz` sets
HALFMOON_FUZZ_MINUTES / HALFMOON_FUZZ_CASES / HALFMOON_FUZZ_SEED for a long one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from halfmoon.conductor.colocated import ColocatedBackend
from halfmoon.api.requests import Limits
from halfmoon.api.server import ServerConfig
from halfmoon.dashboard.routes import mount
from tests.conductor.conftest import CLIENT_SLOS_ONLY, MODEL, RunningApi, run_api
from tests.conftest import EngineFactory
from halfmoon.bench.lora_bench import write_adapter

TOKEN = "fuzz-token"
# A generation is a few engine steps (max_tokens); the schema states these bounds. The prompt
# limit is roomy: a text prompt's length in tokens is the one bound a schema cannot state, and a
# generated text (16 messages at most) stays far below it.
NUM_BLOCKS = 256  # 4096 tokens of KV: the longest prompt plus the largest max_tokens fit
LIMITS = Limits(max_prompt_tokens=2048, max_tokens=4, max_request_bytes=64 * 2**10, max_streams_per_client=8,
                max_stop=4, max_stop_chars=32, max_messages=16, max_id_chars=64)


@dataclass(frozen=True, slots=True)
class FuzzBudget:
    """How long a fuzz run is: `minutes` of each fuzzer (0 = by case count), `cases` Schemathesis
    cases per operation, `seed` for both."""

    minutes: float
    cases: int
    seed: int

    @property
    def long(self) -> bool:
        return self.minutes > 0


def budget_from_env() -> FuzzBudget:
    return FuzzBudget(float(os.environ.get("HALFMOON_FUZZ_MINUTES", "0")),
                      int(os.environ.get("HALFMOON_FUZZ_CASES", "20")),
                      int(os.environ.get("HALFMOON_FUZZ_SEED", "37")))


@pytest.fixture(scope="session")
def fuzz_budget() -> FuzzBudget:
    return budget_from_env()


@pytest.fixture(scope="session")
def fuzz_api(make_engine: EngineFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningApi]:
    tokens = tmp_path_factory.mktemp("fuzz") / "tokens"
    tokens.write_text(TOKEN + "\n")
    backend = ColocatedBackend(make_engine(num_blocks=NUM_BLOCKS), MODEL, max_waiting=64, admission=CLIENT_SLOS_ONLY)
    config = ServerConfig(grpc_port=0, http_port=0, api_token_file=str(tokens), admin_token_file=str(tokens),
                          limits=LIMITS)
    running = run_api(backend, config, [mount])
    yield running
    running.stop()


@pytest.fixture(scope="session")
def fuzz_adapter(fuzz_api: RunningApi, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank-2 LoRA adapter of the fuzzed model's shapes (tests/lora_support.py)."""
    assert fuzz_api.backend.adapters is not None and fuzz_api.backend.adapters.shapes is not None
    return write_adapter(tmp_path_factory.mktemp("fuzz-lora") / "adapter", fuzz_api.backend.adapters.shapes, rank=2,
                         seed=5, targets=("q_proj", "v_proj"), base_name="")


def report_dir(tmp: Path) -> Path:
    out = Path(os.environ.get("HALFMOON_FUZZ_REPORTS", str(tmp)))
    out.mkdir(parents=True, exist_ok=True)
    return out
