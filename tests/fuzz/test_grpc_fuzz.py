"""The gRPC fuzzer (tests/fuzz/grpc_fuzzer.py) against every RPC of a live front door.

The normal suite runs a short seeded pass; `make fuzz FUZZ_MINUTES=10` runs each fuzzer for that
long (HALFMOON_FUZZ_MINUTES). Either way: no call broke the contract (the fuzzer raises, with the
shrunk request), every RPC was called and answered OK at least once, and the engine is left idle.
"""

from __future__ import annotations

from pathlib import Path

import grpc
from hypothesis import strategies as st

from halfmoon.v1 import generation_pb2 as pb
from tests.conductor.conftest import MODEL, RunningApi
from tests.fuzz.conftest import LIMITS, TOKEN, FuzzBudget
from tests.fuzz.grpc_fuzzer import GrpcFuzzer
from tests.fuzz.proto_strategies import Hints

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"]
SHORT_EXAMPLES = 60  # per RPC in the normal suite
# Values a field's meaning makes likely, so that some requests get past validation (mixed with
# each field's whole range, never instead of it).
_TEXT = st.text(min_size=1, max_size=40)
_PLAUSIBLE = st.builds(pb.GenerateRequest, model=st.sampled_from(["", MODEL]), max_tokens=st.integers(1, 4),
                       prompt=_TEXT, stop=st.lists(_TEXT, max_size=2), ignore_eos=st.booleans(),
                       sampling=st.builds(pb.SamplingParams, temperature=st.floats(0, 2), seed=st.integers(0, 99)))
HINTS: Hints = {
    "halfmoon.v1.GenerateRequest": _PLAUSIBLE,
    "halfmoon.v1.GenerateRequest.model": st.sampled_from(["", MODEL]),
    "halfmoon.v1.TokenizeRequest.model": st.sampled_from(["", MODEL]),
    "halfmoon.v1.ChatMessage.role": st.sampled_from(["system", "user", "assistant"]),
    "halfmoon.v1.GenerateRequest.max_tokens": st.integers(1, LIMITS.max_tokens),
    "halfmoon.v1.GenerateRequest.prompt_token_ids": st.integers(0, 1000),
    "halfmoon.v1.GenerateRequest.stop_token_ids": st.integers(0, 1000),
    "halfmoon.v1.GenerateRequest.priority_class": st.sampled_from(["", "interactive", "standard", "batch"]),
    "halfmoon.v1.SamplingParams.temperature": st.floats(0, 2),
    "halfmoon.v1.SamplingParams.top_p": st.floats(0.01, 1),
    "halfmoon.v1.SamplingParams.top_k": st.integers(0, 50),
    "halfmoon.v1.Slo.ttft_ms": st.floats(1, 1e5),
    "halfmoon.v1.Slo.tbt_ms": st.floats(1, 1e5),
}


def adapter_hints(adapter: Path) -> Hints:
    """The admin RPCs: half of the valid requests load the fixture's adapter under one of two
    names, or unload one of them (every RPC must be answered OK at least once)."""
    names = st.sampled_from(["fuzz-a", "fuzz-b"])
    return {"halfmoon.v1.LoadAdapterRequest": st.builds(pb.LoadAdapterRequest, name=names, path=st.just(str(adapter))),
            "halfmoon.v1.UnloadAdapterRequest": st.builds(pb.UnloadAdapterRequest, name=names)}


def test_every_rpc_keeps_the_contract(fuzz_api: RunningApi, fuzz_budget: FuzzBudget, fuzz_adapter: Path) -> None:
    with grpc.insecure_channel(fuzz_api.grpc_target) as channel:
        fuzzer = GrpcFuzzer(channel, SERVICE, TOKEN, {**HINTS, **adapter_hints(fuzz_adapter)})
        if fuzz_budget.long:
            rounds = fuzzer.run_for(fuzz_budget.minutes * 60, fuzz_budget.seed)
        else:
            rounds = 1
            fuzzer.run(SHORT_EXAMPLES, fuzz_budget.seed)
    calls = sum(fuzzer.stats.values())
    print(f"gRPC fuzz: {rounds} rounds, {calls} calls:", dict(sorted(fuzzer.stats.items())))
    assert {m for m, _ in fuzzer.stats} == {m.name for m in SERVICE.methods}
    assert {m for m, code in fuzzer.stats if code == "OK"} == {m.name for m in SERVICE.methods}
    assert fuzz_api.wait_idle() == []
