"""The tensor-parallel collectives on NCCL (engine/parallel.py `TPGroup`; deploy/gpu_check.sh runs
it in phase d; skipped without a CUDA device).

A tensor-parallel engine runs its ranks on CPU over gloo today (EngineConfig refuses cuda with
tp > 1); `TPGroup.join` picks NCCL for a CUDA device. What one GPU allows is exercised here
through the same `TPGroup` code the engine's ranks use:

* one rank on NCCL: all_reduce and the logits gather, the collective counters;
* two ranks on the one device (this process and a child): NCCL refuses two ranks on one GPU
  ("Duplicate GPU detected") on most versions; the test skips with NCCL's own words then, and
  checks the sums when it does not, so the log says which happened.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from halfmoon.engine.parallel import TPGroup, new_store

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL collectives need a CUDA device; this machine has none"),
    pytest.mark.timeout(180),
]
HOST = "127.0.0.1"


def test_one_nccl_rank_reduces_and_gathers_through_the_engines_group() -> None:
    store = new_store(HOST, 0, 1, True, 60.0)
    group = TPGroup.join(store, 0, 1, torch.device("cuda"), timeout_s=60.0)
    assert group.backend == "nccl"
    t = torch.arange(8, dtype=torch.float32, device="cuda")
    assert torch.equal(group.all_reduce(t.clone()), t)
    local = torch.randn(3, 5, device="cuda")
    gathered = group.gather_logits(local, vocab=5, rows=5)
    assert gathered is not None and torch.equal(gathered, local)
    assert group.calls == 2 and group.seconds > 0


CHILD = textwrap.dedent("""
    import sys, torch
    from halfmoon.engine.parallel import TPGroup
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False)
    group = TPGroup.join(store, 1, 2, torch.device("cuda"), timeout_s=60.0)
    group.all_reduce(torch.full((4,), 2.0, device="cuda"))
    torch.cuda.synchronize()
""")


def test_two_nccl_ranks_on_one_device_sum_or_nccl_says_why_not() -> None:
    store = new_store(HOST, 0, 2, True, 60.0)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(store.port)], stderr=subprocess.PIPE, text=True)
    try:
        group = TPGroup.join(store, 0, 2, torch.device("cuda"), timeout_s=60.0)
        t = group.all_reduce(torch.full((4,), 1.0, device="cuda"))
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - NCCL's refusal is the outcome being recorded
        child.kill()
        message = f"{e} {child.communicate(timeout=30)[1]}"
        if "Duplicate GPU" in message or "invalid usage" in message.lower():
            pytest.skip(f"NCCL refuses two ranks on one GPU here: {message[-300:]}")
        raise
    assert child.wait(timeout=60) == 0, child.stderr.read() if child.stderr else ""
    assert torch.equal(t.cpu(), torch.full((4,), 3.0))
