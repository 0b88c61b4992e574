"""`serve`'s GPU plan (conductor/gpu_plan.py): one GPU per worker where there are enough, else an
equal share of one with a memory cap; the cluster config's Ray requests and worker engines."""

from __future__ import annotations

import pytest

from halfmoon.conductor.cluster_config import ClusterConfig
from halfmoon.conductor.gpu_plan import SHARED_HEADROOM, GpuShare, plan_gpus
from halfmoon.core.errors import ConfigError
from halfmoon.engine.config import EngineConfig


def test_cpu_workers_ask_for_no_gpu() -> None:
    assert plan_gpus("cpu", 8, 2) == GpuShare(0.0, 0.0)
    assert plan_gpus("cpu", None, 2) == GpuShare(0.0, 0.0)


def test_one_gpu_each_where_there_are_enough() -> None:
    assert plan_gpus("cuda", 2, 2) == GpuShare(1.0, 0.0)
    assert plan_gpus("cuda", 8, 2, 0.5) == GpuShare(1.0, 0.5)  # the operator's own cap is kept


def test_workers_share_one_gpu_with_a_memory_cap() -> None:
    share = plan_gpus("cuda", 1, 2)
    assert share.gpus == 0.5
    assert share.memory_fraction == pytest.approx((1 - SHARED_HEADROOM) / 2)
    three = plan_gpus("cuda", 1, 3)
    assert 3 * three.gpus <= 1.0 and three.gpus == 0.3333  # Ray's 1e-4 units, rounded down
    assert plan_gpus("cuda", 2, 3).gpus == 0.5  # ceil(3 / 2) = 2 workers per GPU
    assert plan_gpus("cuda", 1, 2, 0.3) == GpuShare(0.5, 0.3)


def test_a_joined_ray_cluster_asks_one_gpu_each() -> None:
    assert plan_gpus("cuda", None, 4) == GpuShare(1.0, 0.0)


def test_no_gpu_visible_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="no CUDA device"):
        plan_gpus("cuda", 0, 2)


def test_cluster_config_uses_the_plan() -> None:
    cpu = ClusterConfig()
    assert cpu.gpus("prefill") == cpu.gpus("decode") == 0.0
    given = ClusterConfig(prefill_gpus=2, decode_gpus=1, engine=EngineConfig(device="cuda"), ray_address="auto")
    assert (given.gpus("prefill"), given.gpus("decode")) == (2.0, 1.0)
    joined = ClusterConfig(engine=EngineConfig(device="cuda"), ray_address="auto")
    assert joined.gpus("decode") == 1.0
    assert all(s.engine.gpu_memory_fraction == 0.0 for s in joined.specs(None))
