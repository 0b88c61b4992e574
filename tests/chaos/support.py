"""The chaos suite's streams: N concurrent greedy gRPC streams against a running cluster, each
recording its tokens, its errors and when its k-th token arrived, so a test can strike (kill a
worker by pid, kill Redis, drop the KV connections) while every stream is mid-flight."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

import grpc

from halfmoon.v1 import generation_pb2 as pb
from halfmoon.v1 import generation_pb2_grpc as pb_grpc
from tests.conductor.conftest import RunningApi
from tests.e2e.support import worker_load
from tests.waiting import wait_until

STREAM_TIMEOUT_S = 240.0


@dataclass
class Stream:
    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    error: BaseException | None = None
    started: threading.Event = field(default_factory=threading.Event)  # its first `warm` tokens arrived
    gaps: list[float] = field(default_factory=list)  # seconds between consecutive chunks
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def longest_stall_s(self) -> float:
        return max(self.gaps, default=0.0)


class Streams:
    """`n` streams started at once; `wait_started()` once each has `warm` tokens."""

    def __init__(self, target: str, prompts: list[list[int]], max_tokens: int, warm: int = 4,
                 cache_salt: str = "") -> None:
        """`cache_salt`: none of another run's cached prefixes is hit (the output is the same)."""
        self.streams = [Stream(p, max_tokens) for p in prompts]
        self._threads = [threading.Thread(target=self._run, args=(target, s, warm, cache_salt), daemon=True)
                         for s in self.streams]
        for t in self._threads:
            t.start()

    @staticmethod
    def _run(target: str, s: Stream, warm: int, cache_salt: str) -> None:
        try:
            with grpc.insecure_channel(target) as channel:
                req = pb.GenerateRequest(prompt_token_ids=s.prompt, max_tokens=s.max_tokens, ignore_eos=True,
                                         cache_salt=cache_salt)
                last = time.monotonic()
                for r in pb_grpc.GenerationStub(channel).Generate(req, timeout=STREAM_TIMEOUT_S):
                    now = time.monotonic()
                    if r.token_ids:
                        s.gaps.append(now - last)
                        last = now
                    s.tokens.extend(r.token_ids)
                    if len(s.tokens) >= warm:
                        s.started.set()
        except BaseException as e:  # the test asserts on it
            s.error = e
        finally:
            s.started.set()
            s.done.set()

    def wait_started(self, timeout_s: float = 120.0) -> None:
        for s in self.streams:
            assert s.started.wait(timeout_s), "a stream did not start"

    def finish(self, timeout_s: float = STREAM_TIMEOUT_S) -> list[list[int]]:
        for s in self.streams:
            assert s.done.wait(timeout_s), "a stream did not finish"
        errors = [s.error for s in self.streams if s.error is not None]
        assert not errors, f"{len(errors)} client-visible errors: {errors[:2]}"
        return [s.tokens for s in self.streams]

    @property
    def longest_stall_s(self) -> float:
        return max(s.longest_stall_s for s in self.streams)


def kill9(api: RunningApi, worker_id: str) -> int:
    """kill -9 the worker's process (its pid as the Conductor knows it); the pid."""
    pid = api.backend.manager.workers[worker_id].pid
    assert pid > 0
    os.kill(pid, signal.SIGKILL)
    return pid


def assert_no_leaks(api: RunningApi) -> None:
    """Every decode reservation given back, every block free or prefix cache, nothing pending on
    the Conductor's ledgers, and each worker's own integrity check passes."""
    import ray

    for w in api.backend.manager.role("decode"):
        wait_until(lambda w=w: worker_load(api, w.worker_id).reserved == 0, timeout_s=60,
                   what=f"{w.worker_id}'s reservations released")
        load = worker_load(api, w.worker_id)
        assert load.requests == 0 and load.free_blocks == load.total_blocks, (w.worker_id, load)
    for w in api.backend.manager.workers.values():
        wait_until(lambda w=w: not w.pending.depth and not w.bound.jobs, timeout_s=30,
                   what=f"the Conductor's ledgers of {w.worker_id} empty")
        ray.get(w.api.handle.check_integrity.remote(), timeout=60)  # raises IntegrityError on a broken invariant
    stats = api.backend.stats()
    assert (stats.requests_running, stats.requests_waiting) == (0, 0)


def all_alive(api: RunningApi) -> bool:
    return all(w.alive for w in api.backend.manager.workers.values())
