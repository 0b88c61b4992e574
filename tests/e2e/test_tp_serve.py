"""Tensor-parallel workers as Ray actors (issue 35): prefill TP=2 -> decode TP=1 over tcp, 16
concurrent requests of mixed lengths token-identical to one process; the decode worker's one
rank received every prefill rank's heads (tests/conductor/test_tp_cluster.py checks the bytes per
rank in process, both directions)."""

from __future__ import annotations

from pathlib import Path

import pytest

from halfmoon.engine.engine import Engine
from tests.e2e.support import generate_all, prompts, reference, start_cluster, worker_load

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_prefill_tp2_to_decode_tp1_under_ray_is_token_identical(tmp_path: Path, engine: Engine) -> None:
    api = start_cluster(tmp_path, 1, 1, None, prefill_tp=2)
    try:
        ids = prompts(engine)
        max_tokens = [3 + (i * 7) % 11 for i in range(16)]
        assert generate_all(api.grpc_target, ids, max_tokens) == reference(engine, ids, max_tokens)
        prefill, decode = worker_load(api, "prefill-0"), worker_load(api, "decode-0")
        assert (prefill.tp, decode.tp) == (2, 1)
        assert len(decode.kv_rank_bytes) == 1 and decode.kv_rank_bytes[0] == decode.kv_bytes_received > 0
    finally:
        api.stop()
