"""One thread that steps an engine, for servers and workers.

```
callers (any thread)                         engine thread
  loop.call(fn)       -> Future ---------->   runs fn between steps (reserve, add_prefilled, ...)
  loop.watch(id, sink)                         engine.step() -> outputs -> sink(out) per request
  engine.add_request / abort (thread-safe)
```

Verbs that touch the scheduler's state outside `add_request`/`abort` (`reserve_blocks`,
`release_blocks`, reading blocks for another worker) must run through `call`, never from a
caller's thread. A step that raises is a bug: every watcher gets the error, the loop stops, and
`failure` says why.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from halfmoon.core.messages import TokenChunk
from halfmoon.engine.engine import Engine
from halfmoon.engine.errors import RankLostError

log = logging.getLogger(__name__)

T = TypeVar("T")
Sink = Callable[[TokenChunk | BaseException], None]


class EngineLoop:
    def __init__(self, engine: Engine, name: str = "engine-loop") -> None:
        self.engine = engine
        self.steps = 0  # steps started (one in flight counts)
        self.failure: BaseException | None = None
        self._sinks: dict[str, Sink] = {}
        self._calls: list[tuple[Callable[[], object], Future]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        # a tensor-parallel engine's step that lost a rank: told here before the watchers fail
        # (a Ray worker exits, so the Conductor moves its requests instead of failing them)
        self.on_rank_lost: Callable[[RankLostError], None] | None = None
        engine.scheduler.on_fetched = self.wake  # a remote pull ended: its request can be admitted

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the engine thread before the next step; its result (or error) in the future."""
        future: Future[T] = Future()
        with self._lock:
            if self.failure is not None or self._stop.is_set():
                future.set_exception(RuntimeError(f"the engine loop is not running ({self.failure})"))
                return future
            self._calls.append((fn, future))
        self._wake.set()
        return future

    def watch(self, request_id: str, sink: Sink) -> None:
        """Send `request_id`'s outputs to `sink` (on the engine thread; keep it short)."""
        with self._lock:
            self._sinks[request_id] = sink

    def watch_async(self, request_id: str) -> asyncio.Queue[TokenChunk | BaseException]:
        """`watch` into an asyncio queue of the running event loop (call from that loop)."""
        aloop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenChunk | BaseException] = asyncio.Queue()

        def sink(item: TokenChunk | BaseException) -> None:
            try:
                aloop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass

        self.watch(request_id, sink)
        return queue

    def unwatch(self, request_id: str) -> None:
        with self._lock:
            self._sinks.pop(request_id, None)

    def watching(self) -> int:
        with self._lock:
            return len(self._sinks)

    def fail(self, error: BaseException) -> None:
        """From any thread: fail every watcher and waiting call, take no new work (the engine
        cannot step any more, e.g. a tensor-parallel rank is gone)."""
        self._fail(error)
        self._stop.set()
        self._wake.set()

    def wake(self) -> None:
        """New work was handed to the engine (add_request / abort from another thread)."""
        self._wake.set()

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        while not self._stop.is_set():
            self._run_calls()
            if not self.engine.has_unfinished() or self.engine.only_fetching():
                idle_wait = 0.5
                if self.engine.pushes.holding:  # pushes still leaving: free their blocks soon
                    self.engine.pushes.release_sent()
                    idle_wait = 0.002
                self._wake.wait(timeout=idle_wait)
                self._wake.clear()
                continue
            self.steps += 1
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug (or a lost rank): fail every watcher loudly, take no new work
                log.exception("engine step failed")
                if isinstance(e, RankLostError) and self.on_rank_lost is not None:
                    self.on_rank_lost(e)
                self._fail(e)
                return
            for out in outputs:
                self._route(out)
        self._fail_calls(RuntimeError("the engine loop stopped"))

    def _run_calls(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, future in calls:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the caller through its future
                future.set_exception(e)

    def _route(self, out: TokenChunk) -> None:
        with self._lock:
            sink = self._sinks.get(out.request_id)
            if out.finished:
                self._sinks.pop(out.request_id, None)
        if sink is not None:
            sink(out)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self.failure = error
            sinks, self._sinks = list(self._sinks.values()), {}
        for sink in sinks:
            sink(error)
        self._fail_calls(error)

    def _fail_calls(self, error: BaseException) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for _, future in calls:
            if not future.done():
                future.set_exception(error)
