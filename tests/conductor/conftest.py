"""A real front door (gRPC + HTTP on loopback) over a real co-located engine, in this process.

`api` (tests/server_fixtures.py) is one session-wide server on free ports; `start_api(**config)`
starts others (auth, TLS, small limits) for a module. The server runs its event loop on its own thread, like `halfmoon
serve` does on its main thread; the engine steps on the backend's thread.

`scripted` is a real front door over a `ScriptedBackend`: no engine, the test says what the
backend answers (a rejection, a prediction) and reads what the front door handed it.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

from halfmoon.conductor.admission import AdmissionConfig
from halfmoon.conductor.backend import BackendStats, GenerationBackend, GenerationInput
from halfmoon.conductor.colocated import ColocatedBackend
from halfmoon.api.server import Endpoints, Extension, ServerConfig, serve
from halfmoon.core.messages import RequestEnd, SloPrediction, Timings, TokenChunk, Usage
from halfmoon.core.params import FinishReason
from halfmoon.engine.engine import Engine
from halfmoon.results import ModelInfo
from tests.conftest import idle_problems
from tests.waiting import poll

MODEL = "smollm2"
T = TypeVar("T")
# Predictive admission on the objectives a request sends, none from the server's classes.
CLIENT_SLOS_ONLY = AdmissionConfig(interactive_ttft_ms=0, interactive_tbt_ms=0, standard_ttft_ms=0,
                                   standard_tbt_ms=0)


@dataclass
class RunningApi:
    backend: ColocatedBackend
    endpoints: Endpoints
    stop: Callable[[], None]
    loop: asyncio.AbstractEventLoop | None = None  # the server's, where its backend lives

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Run `coro` on the server's event loop (the backend is only touched there)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

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


def run_api(backend: GenerationBackend, config: ServerConfig, extensions: Sequence[Extension] = ()) -> RunningApi:
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

        await serve(backend, config, stop, announce, extensions)

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

    return RunningApi(backend, ready[0], stop, holder["loop"])


class ScriptedBackend(GenerationBackend):
    """A backend without an engine whose answers a test sets. Each request pops the next of
    `rejections` and raises it; with none left it answers one token, then the last chunk with
    `prediction`. `inputs` holds what the front door handed it (validated requests). A text
    in `texts` is the next answer instead (a few characters a chunk, finish `stop`): what a
    model would write, for tests of how the front door reads it (tool calls)."""

    TOKEN = 42

    def __init__(self, model: ModelInfo, tokenizer: Any, kv_capacity_tokens: int) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.kv_capacity_tokens = kv_capacity_tokens
        self.admission_config = AdmissionConfig()
        self.rejections: deque[BaseException] = deque()
        self.prediction: SloPrediction | None = None
        self.inputs: list[GenerationInput] = []
        self.texts: deque[str] = deque()

    def reset(self) -> None:
        self.texts.clear()
        self.rejections.clear()
        self.prediction = None
        self.inputs.clear()

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def ready(self) -> bool:
        return True

    def stats(self) -> BackendStats:
        return BackendStats(0, 0, 0, 0, 0)

    async def generate(self, inp: GenerationInput) -> AsyncIterator[TokenChunk]:
        self.inputs.append(inp)
        if self.rejections:
            raise self.rejections.popleft()
        rid = inp.request_id or "scripted"
        if self.texts:
            async for chunk in self._answer(rid, self.texts.popleft(), len(inp.prompt_ids)):
                yield chunk
            return
        yield TokenChunk(rid, [self.TOKEN], "x")
        end = RequestEnd(FinishReason.LENGTH, None, Usage(len(inp.prompt_ids), 0, 1),
                         Timings(0.0, 1.0, 0.0, 1.0, 0.0, 1.0), prediction=self.prediction)
        yield TokenChunk(rid, [], "", end)


    async def _answer(self, rid: str, text: str, prompt_tokens: int) -> AsyncIterator[TokenChunk]:
        pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
        for piece in pieces:
            yield TokenChunk(rid, [self.TOKEN], piece)
        end = RequestEnd(FinishReason.STOP, None, Usage(prompt_tokens, 0, len(pieces)),
                         Timings(0.0, 1.0, 0.0, 1.0, 0.0, 1.0), prediction=self.prediction)
        yield TokenChunk(rid, [], "", end)


SCRIPTED_KV_TOKENS = 64  # the scripted backend's decode KV: prompt + max_tokens must fit


@pytest.fixture(scope="session")
def scripted_api(shared_engine: Engine) -> Iterator[RunningApi]:
    model = ModelInfo(MODEL, shared_engine.max_model_len, shared_engine.model_config.vocab_size)
    backend = ScriptedBackend(model, shared_engine.tokenizer, SCRIPTED_KV_TOKENS)
    running = run_api(backend, ServerConfig(grpc_port=0, http_port=0))
    yield running
    running.stop()


@pytest.fixture
def scripted(scripted_api: RunningApi) -> Iterator[RunningApi]:
    """The scripted server, its backend's script cleared (`scripted.backend`)."""
    scripted_api.backend.reset()
    yield scripted_api
    scripted_api.backend.reset()
