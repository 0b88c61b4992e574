"""The worker actors' Ray options (conductor/ray_workers.py). The task-event switch is what keeps
Ray's GCS flat over hours of requests (the soak, issue 37): each actor call would otherwise leave
~3.4 KB of events in gcs_server, up to 100 000 calls."""

from __future__ import annotations

from halfmoon.conductor.cluster_config import ClusterConfig
from halfmoon.conductor.ray_workers import NAMESPACE, actor_options


def test_worker_actors_record_no_task_events_and_restart_forever() -> None:
    config = ClusterConfig(prefill=1, decode=2)
    for spec in config.specs(redis_url=None):
        options = actor_options(config, spec)
        assert options["enable_task_events"] is False, spec.worker_id
        assert options["name"] == spec.worker_id and options["namespace"] == NAMESPACE
        assert options["resources"] == {config.resource(spec.role): 1}
        assert options["max_restarts"] == -1 and options["max_task_retries"] == 0
        assert "num_gpus" not in options


def test_gpu_workers_ask_ray_for_their_gpus() -> None:
    config = ClusterConfig(prefill=1, decode=1, prefill_gpus=1, decode_gpus=1, ray_address="auto")
    options = {spec.role: actor_options(config, spec) for spec in config.specs(redis_url=None)}
    assert options["prefill"]["num_gpus"] == 1 and options["decode"]["num_gpus"] == 1


def test_workers_on_a_joined_ray_cluster_run_their_worker_threads_unpinned() -> None:
    """Locally each worker is pinned to its cores (torch: one thread per core); on a cluster
    joined with --ray-address nothing is pinned, and torch's threads were left to the node's
    environment instead of --worker-threads: now they are --worker-threads."""
    joined = ClusterConfig(prefill=1, decode=1, worker_threads=1, ray_address="auto")
    spec = joined.spec("prefill", 0, 0, None)
    assert spec.cpus is None and spec.engine_config().num_threads == 1
    local = ClusterConfig(prefill=1, decode=1, worker_threads=1).spec("decode", 0, 1, None)
    assert local.cpus is not None and local.engine_config().num_threads == 1
