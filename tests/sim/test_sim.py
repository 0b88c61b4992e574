"""The simulator: exact timings on a hand-checkable cost model, prefix hits against an independent
count, overload against the admission policies, and proof that the production objects decide."""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

import pytest

from halfmoon.conductor import admission as conductor_admission
from halfmoon.conductor import router as conductor_router
from halfmoon.kvpool import block_pool as kvpool_block_pool
from halfmoon.bench.trace import synthesize_tokens
from halfmoon.conductor.admission import AdmissionConfig
from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.dispatch import Dispatcher
from halfmoon.sim.cluster import SimConfig, Simulator, simulate, simulate_series
from halfmoon.sim.report import summarize
from halfmoon.sim.trace import HASH_BLOCK_TOKENS, read_trace
from halfmoon.sim.workload import SimRequest, Workload, build, load
from tests.sim.support import sample_trace

ROOT = Path(__file__).resolve().parents[2]
# prefill(n, c) = 100 + 1*n ms; decode step = 10 ms + 0*b + 0*k; transfer 1 GB/s of 1000 B/token
FLAT = CostModel((100.0, 1.0, 0.0, 0.0), (10.0, 0.0, 0.0), 1e9, 1000, "test: flat")
LOOSE = AdmissionConfig(standard_ttft_ms=60_000, standard_tbt_ms=10_000)
HOLD = LOOSE.admit_window_ms / 1e3  # a cluster's admission window holds each arrival (co-located: none)


def one(prompt: int = 1000, output: int = 5, at: float = 0.0, index: int = 0, blocks: tuple[bytes, ...] = ()
        ) -> SimRequest:
    return SimRequest(index, at, prompt, output, blocks)


# ---------------------------------------------------------------- timings


def test_one_request_through_1p1d_has_the_cost_models_timings() -> None:
    r = simulate(Workload((one(),), 1.0), SimConfig(kv_tail=0.5, admission=LOOSE), FLAT).records[0]
    # 1000 prompt tokens in two steps of the 512-token budget, each 100 ms + 1 ms a token
    prefill, tail, step = 1.200, 0.5 * 1000 * 1000 / 1e9, 0.010
    assert r.status == "ok"
    assert HOLD > 0  # the default window
    assert r.ttft_s == pytest.approx(HOLD + prefill + tail + step)  # the first token rides a decode step
    assert r.tbt_s == pytest.approx(step)
    assert r.end_s == pytest.approx(HOLD + prefill + tail + 5 * step)


def test_one_request_co_located_chunks_its_prefill() -> None:
    config = SimConfig(colocated=True, chunk=400, admission=LOOSE)
    r = simulate(Workload((one(),), 1.0), config, FLAT).records[0]
    chunks = (100 + 400) + (100 + 400) + (100 + 200)  # 1000 tokens in 400-token steps, ms
    assert r.ttft_s == pytest.approx(chunks / 1e3)  # the last chunk samples the first token
    assert r.tbt_s == pytest.approx(0.010)


def test_speculative_tokens_per_step_shorten_decode_and_admission_counts_them() -> None:
    """Three tokens a step: a request decodes in a third of the steps, each costing the rows of
    three (the flat model: 10 ms whatever the rows), so its TBT is a third and admission's
    predicted TBT too."""
    config = SimConfig(kv_tail=0.5, admission=LOOSE, tokens_per_step=3.0)
    sim = Simulator(config, FLAT)
    r = sim.run(Workload((one(output=7),), 1.0)).records[0]
    step = 0.010 / 3
    assert r.tbt_s == pytest.approx(step)
    assert r.ttft_s == pytest.approx(HOLD + 1.200 + 0.0005 + step)
    assert r.end_s == pytest.approx(HOLD + 1.200 + 0.0005 + 7 * step)
    assert all(ledger.tokens_per_step == 3.0 for ledger in sim.decode_ledgers.values())
    plain = simulate(Workload((one(output=7),), 1.0), SimConfig(kv_tail=0.5, admission=LOOSE), FLAT).records[0]
    assert r.predicted_tbt_ms == pytest.approx(plain.predicted_tbt_ms / 3)


def test_overhead_delays_the_first_token_outside_the_engines() -> None:
    config = SimConfig(kv_tail=0.5, admission=LOOSE, overhead_ms=250.0)
    r = simulate(Workload((one(),), 1.0), config, FLAT).records[0]
    assert r.ttft_s == pytest.approx(HOLD + 1.200 + 0.0005 + 0.250 + 0.010)
    colocated = simulate(Workload((one(),), 1.0), SimConfig(colocated=True, chunk=400, admission=LOOSE,
                                                               overhead_ms=250.0), FLAT).records[0]
    assert colocated.ttft_s == pytest.approx(0.250 + 1.300)


def test_replays_in_series_share_one_conductor() -> None:
    # The second replay's admission starts from what the first taught it (as a live server's),
    # on fresh workers; its times are its own (0 = its start).
    w = Workload((one(index=0), one(index=1, at=0.5)), 1.0)
    first, second = simulate_series([w, w], SimConfig(admission=LOOSE, overhead_ms=100.0), FLAT, gap_s=5.0)
    assert [r.ttft_s for r in first.records] == pytest.approx([r.ttft_s for r in second.records])
    assert second.records[0].end_s == pytest.approx(first.records[0].end_s)
    sim = Simulator(SimConfig(admission=LOOSE), FLAT)
    sim.run(w)
    fit_before = sim.dispatcher.admission.calibration.ttft
    after = Simulator(SimConfig(admission=LOOSE), FLAT, after=sim)
    assert after.dispatcher is sim.dispatcher and after.clock is sim.clock
    assert after.dispatcher.admission.calibration.ttft == fit_before


def test_a_decode_batch_shares_its_steps() -> None:
    # Two requests whose KV arrives at once decode in the same steps: the same TBT, and the
    # second's prefill waited for the first's (one prompt a step, serve's default).
    w = Workload((one(index=0), one(index=1)), 1.0)
    a, b = simulate(w, SimConfig(kv_tail=0.0, admission=LOOSE), FLAT).records
    assert b.ttft_s == pytest.approx(a.ttft_s + 1.200, abs=0.011)
    assert a.tbt_s == pytest.approx(0.010) and b.tbt_s == pytest.approx(0.010)


def test_ledgers_and_caches_are_empty_after_a_run() -> None:
    for config in (SimConfig(prefill=2, decode=2, admission=LOOSE), SimConfig(colocated=True, admission=LOOSE)):
        sim = Simulator(config, FLAT)
        result = sim.run(load(sample_trace(), speed=4.0, max_input_tokens=2048, max_output_tokens=32))
        assert {r.status for r in result.records} <= {"ok", "rejected"}
        sim.check_integrity()  # run() checked it too: no booking outlives its request


# ---------------------------------------------------------------- prefix hits


def leading_ids_seen(path: Path, max_input: int | None, engine_block: int = 16) -> tuple[int, int]:
    """Independent count, on the tokens the live replay sends (bench/trace.py): each request's
    leading 16-token engine blocks whose chained content an earlier request computed (a block is
    cached once full; never the last prompt token), in tokens; and the prompt tokens in all."""
    seen: set[bytes] = set()
    hit = prompt = 0
    for r in sorted(read_trace(path), key=lambda r: r.timestamp):
        tokens = synthesize_tokens(r)[:max_input or r.input_length]
        chain, keys = hashlib.sha256(), []
        for start in range(0, len(tokens) // engine_block * engine_block, engine_block):
            chain.update(tokens[start:start + engine_block].tobytes())
            keys.append(chain.copy().digest())
        usable = (len(tokens) - 1) // engine_block
        k = 0
        while k < usable and keys[k] in seen:
            k += 1
        hit += k * engine_block
        prompt += len(tokens)
        seen.update(keys)
    return hit, prompt


@pytest.mark.parametrize("colocated", [False, True])
def test_unbounded_tiers_hit_every_reused_leading_block(colocated: bool) -> None:
    # Sparse arrivals (x0.01) on a fast cost model: every request is done before the next one,
    # so what was computed before is exactly what an earlier request held.
    path = sample_trace()
    config = SimConfig(colocated=colocated, device_tokens=10**8, admission=LOOSE)
    result = simulate(load(path, speed=0.01), config, FLAT)
    assert all(r.status == "ok" for r in result.records)
    hit, prompt = leading_ids_seen(path, None)
    assert hit > 0
    assert sum(r.cached_tokens[0] for r in result.records) == hit
    assert summarize(result)["hit_rate"]["device"] == pytest.approx(hit / prompt, abs=1e-4)


def test_a_partial_block_hits_the_tokens_both_prompts_hold(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]},
            {"timestamp": 10_000, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]},
            {"timestamp": 20_000, "input_length": 700, "output_length": 2, "hash_ids": [1, 2]},
            {"timestamp": 30_000, "input_length": 1100, "output_length": 2, "hash_ids": [1, 2, 3]},
            {"timestamp": 40_000, "input_length": 1100, "output_length": 2, "hash_ids": [1, 2, 4]},
            {"timestamp": 50_000, "input_length": 530, "output_length": 2, "hash_ids": [1, 2]}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = simulate(load(trace), SimConfig(admission=LOOSE), FLAT).records
    # id 2's tokens are the same at every length: 600 tokens seen before hit all but the last, in
    # whole 16-token engine blocks (592); the 700-token prompt shares those 600 (592), and its own
    # 188 tokens of id 2 are cached after it; the first 1100-token prompt holds the whole block 2
    # (cached: 700 of it, 1024 - 324 = 700 -> 688 rounded to engine blocks); the second finds
    # blocks 1 and 2 whole; 530 tokens: all but the last.
    assert [r.cached_tokens[0] for r in records] == [0, 592, 592, 688, 1024, 528]
    hit, _ = leading_ids_seen(trace, None)
    assert hit == sum(r.cached_tokens[0] for r in records)


def test_a_small_device_tier_demotes_to_host_and_hits_there() -> None:
    path = sample_trace()
    small = SimConfig(device_tokens=8 * HASH_BLOCK_TOKENS, host_tokens=10**7, admission=LOOSE)  # >= any prompt
    rates = summarize(simulate(load(path, speed=0.01), small, FLAT))["hit_rate"]
    hit, prompt = leading_ids_seen(path, None)
    assert rates["host"] > 0
    # Host hits continue a device hit only up to the first block on neither tier (KVTiers.match,
    # as engine/scheduler.py admits): a chain split device/host/device loses its tail.
    assert 0.97 * hit / prompt <= rates["device"] + rates["host"] <= hit / prompt


# ---------------------------------------------------------------- overload


def test_predictive_sheds_overload_that_none_lets_collapse() -> None:
    # Run 7's setting (docs/BENCHMARKS.md) at 4x its 1x rate, on a cost model of this machine.
    w = load(sample_trace(), speed=0.8, max_input_tokens=768, max_output_tokens=64)
    slo = {"standard_ttft_ms": 5000, "standard_tbt_ms": 300}
    cpu = CostModel((150.0, 3.4, 0.0012, 0.0013), (95.0, 5.3, 0.037), 2e9, 46080, "test: this machine")
    none = summarize(simulate(w, SimConfig(admission=AdmissionConfig(admission="none", **slo)), cpu))
    predictive = summarize(simulate(w, SimConfig(admission=AdmissionConfig(**slo)), cpu))
    assert set(none["rejected"]) <= {"kv_capacity", "queue_full"}  # never for the SLOs
    assert none["admitted_ok_pct"] < 50
    assert sum(predictive["rejected"].values()) > 0
    assert predictive["admitted_ok_pct"] >= 99
    assert predictive["goodput_rps"] > 10 * none["goodput_rps"]


# ---------------------------------------------------------------- the production objects


def test_the_production_router_admission_and_block_pool_decide(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"route": 0, "decide": 0, "allocate": 0}

    def counting(cls: type, name: str) -> None:
        original = getattr(cls, name)

        def wrapper(self, *a, **kw):  # type: ignore[no-untyped-def]
            calls[name if name != "decide" else "decide"] += 1
            return original(self, *a, **kw)

        monkeypatch.setattr(cls, name, wrapper)

    counting(conductor_router.Router, "route")
    counting(conductor_admission.Admission, "decide")
    counting(kvpool_block_pool.BlockPool, "allocate")
    w = load(sample_trace(), speed=1.0, max_input_tokens=2048, max_output_tokens=16)
    sim = Simulator(SimConfig(prefill=2, decode=1, admission=LOOSE), FLAT)
    assert type(sim.dispatcher) is Dispatcher
    sim.run(w)
    n = len(w.requests)
    assert calls["route"] == n and calls["decide"] == n and calls["allocate"] >= n


def test_only_the_dispatcher_calls_the_router_and_admission() -> None:
    """The cluster backend, the co-located backend and the simulator reach Router.route and
    Admission.decide only through conductor/dispatch.py: no copy of the decision kept in step."""
    callers = set()
    for path in [*ROOT.glob("halfmoon/conductor/*.py"), *ROOT.glob("halfmoon/sim/*.py")]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("route", "decide", "candidate"):
                if isinstance(node.value, ast.Attribute) and node.value.attr in ("router", "admission"):
                    callers.add(path.name)
    assert callers == {"dispatch.py"}


# ---------------------------------------------------------------- workload


def test_workload_caps_windows_and_chains_block_ids(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 0, "hash_ids": [1, 2, 3]},
            {"timestamp": 1000, "input_length": 600, "output_length": 50, "hash_ids": [1, 9]},
            {"timestamp": 5000, "input_length": 100, "output_length": 5, "hash_ids": [9]}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    w = build(read_trace(trace), speed=2.0, window_s=1.0, max_input_tokens=1024, max_output_tokens=40)
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in w.requests] == [(0.0, 1024, 1), (0.5, 600, 40)]
    assert w.duration_s == 1.0
    a, b = w.requests
    assert len(a.blocks) == 2 and len(b.blocks) == 2 and a.blocks[0] == b.blocks[0]  # a partial last block too
    assert load(trace).requests[0].blocks[:2] == a.blocks and len(load(trace).requests[0].blocks) == 3
    shorter = build(read_trace(trace), max_input_tokens=580).requests[1]
    assert shorter.blocks == b.blocks  # 68 vs 88 tokens of id 9: one block, the cache holds how much of it
    assert load(trace).requests[2].blocks != (b.blocks[1],)  # hash id 9 after root != after id 1
