"""Workers sharing cores in the simulator (sim/engines.py `Cores`, SimConfig.cores): CPU workers
on one machine step slower while more of them step than it has cores, as processes share an OS's
cores; the live planner's advisor learns the share from where its workers run."""

from __future__ import annotations

import dataclasses
import json

import pytest

from halfmoon.conductor.admission import AdmissionConfig
from halfmoon.core.errors import ConfigError
from halfmoon.core.messages import EngineInfo
from halfmoon.sim import builtin
from halfmoon.sim.advisor import shared_cores
from halfmoon.sim.cluster import SimConfig, simulate, unshared_scale
from halfmoon.sim.trace import parse_line
from halfmoon.sim.workload import Workload, build


def burst(prompts: list[int], output: int = 2, gap_ms: int = 0) -> Workload:
    rows = [{"timestamp": n * gap_ms, "input_length": p, "output_length": output,
             "hash_ids": list(range(100 * n, 100 * n + -(-p // 512)))} for n, p in enumerate(prompts)]
    return build([parse_line(json.dumps(r), n) for n, r in enumerate(rows, start=1)], source="burst")


@pytest.fixture(scope="module")
def cost():
    return builtin.load("llama3-8b-h100")


def ttfts(workload: Workload, config: SimConfig, cost) -> list[float]:
    records = simulate(workload, config, cost).records
    assert all(r.status == "ok" for r in records), [r.reason for r in records]
    return [r.ttft_s for r in records]


def test_two_prefill_workers_on_one_core_take_twice_as_long(cost) -> None:
    two = burst([8000, 8000])
    base = SimConfig(prefill=2, decode=1, admission=AdmissionConfig(admission="none"))
    own = ttfts(two, base, cost)
    shared = ttfts(two, SimConfig(**{**_fields(base), "cores": 1.0}), cost)
    enough = ttfts(two, SimConfig(**{**_fields(base), "cores": 3.0}), cost)
    assert own == enough  # as many cores as workers stepping: no sharing
    for alone, halved in zip(own, shared, strict=True):  # every prefill step took twice as long
        assert 1.8 * alone < halved < 2.0 * alone         # (the KV handoff and the decode step not)


def test_a_decode_stretch_slows_when_a_prefill_starts_beside_it(cost) -> None:
    """One request decodes 400 tokens alone; a second arrives mid-way and prefills on the other
    worker: on one core, the decoding request's steps stretch while that prefill runs."""
    work = burst([200, 30000], output=400, gap_ms=1000)
    base = SimConfig(prefill=2, decode=1, admission=AdmissionConfig(admission="none"))
    alone = simulate(work, base, cost).records[0]
    shared = simulate(work, SimConfig(**{**_fields(base), "cores": 1.0}), cost).records[0]
    assert shared.end_s > alone.end_s + 0.5 * cost.est_prefill_ms(30000) / 1e3


def test_with_shared_cores_the_scale_leaves_out_the_share_it_measured(cost) -> None:
    """A live cost model's `prefill_scale` is the slowdown a start-up burst measured with every
    worker busy: on four workers and two cores, x2 of it is the sharing `Cores` times already;
    counted twice, a 400-token prefill was simulated at 1.4-2.5 s that measured 0.7-1.1 s live
    (the planner bench). Where no core is shared (1P1D on two), the scale is all other cost."""
    scaled = dataclasses.replace(cost, prefill_scale=2.0)
    one = burst([8000])
    base = SimConfig(prefill=1, decode=1, admission=AdmissionConfig(admission="none"))
    (at_profile,) = ttfts(one, base, cost)
    assert ttfts(one, SimConfig(**{**_fields(base), "cores": 1.0}), scaled) == [at_profile]  # x2 = the share
    (not_shared,) = ttfts(one, SimConfig(**{**_fields(base), "cores": 2.0}), scaled)
    assert not_shared > 1.8 * at_profile
    assert unshared_scale(2.64, SimConfig(prefill=2, decode=2, cores=2.0)) == pytest.approx(1.32)
    assert unshared_scale(1.2, SimConfig(prefill=3, decode=1, cores=1.0)) == 1.0  # never below the profile


def test_cores_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="cores"):
        SimConfig(cores=0.0)


def info(host: str, cores: int, threads: int = 1, device: str = "cpu") -> EngineInfo:
    return EngineInfo(2048, 100, "fp", 16, "bfloat16", 1024, device=device, host=host, cores=cores, threads=threads)


def test_the_live_share_is_each_hosts_cores_over_its_workers_threads() -> None:
    assert shared_cores([info("a", 2)] * 4) == 2.0  # the CPU bench: four workers, two cores
    assert shared_cores([info("a", 2, threads=2)] * 2) == 1.0
    assert shared_cores([info("a", 1)] * 2 + [info("b", 8)] * 2) == 3.0  # b's two at full speed
    assert shared_cores([info("a", 16)] * 4) is None  # a core each
    assert shared_cores([info("a", 2, device="cuda")] * 4) is None  # a GPU each
    assert shared_cores([]) is None


def _fields(config: SimConfig) -> dict:
    return {f: getattr(config, f) for f in config.__dataclass_fields__}


def test_the_planner_bench_compares_a_cpu_machine_with_and_without_shared_cores(tmp_path, cost) -> None:
    """`bench planner-sim` on another machine's cost model and day: four workers, with and without
    `--cores 2`; the comparison runs both and the shared run says so."""
    from halfmoon.bench.planner_sim import main as bench

    model = tmp_path / "cost.json"
    model.write_text(cost.to_json())
    phases = json.dumps([{"name": "documents", "duration_s": 6, "rate": 6.0, "input_tokens": [6000, 8000],
                          "output_tokens": [4, 8]},
                         {"name": "chat", "duration_s": 6, "rate": 20.0, "input_tokens": [100, 300],
                          "output_tokens": [200, 400]}])
    common = ["--workers", "4", "--cost-model", str(model), "--phases", phases, "--interval-s", "2",
              "--window-s", "4", "--advisor-requests", "60", "--json"]
    results = {}
    for name, extra in (("own", []), ("shared", ["--cores", "2"])):
        assert bench([*common, *extra, "--out", str(tmp_path / name)]) == 0
        results[name] = json.loads((tmp_path / name / "planner_sim.json").read_text())
    assert results["shared"]["cores"] == 2.0 and results["own"]["cores"] is None
    assert len(results["own"]["per_phase"]) == 2 and results["own"]["workers"] == 4
    own, shared = results["own"]["goodput_rps"], results["shared"]["goodput_rps"]
    assert shared["static"] <= own["static"]  # sharing two cores serves no more than a core each
