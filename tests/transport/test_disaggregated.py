"""Prefill in one engine, decode in another, KV pushed layer by layer: the invariant of docs/ARCHITECTURE.md ("A disaggregated request")
(a disaggregated greedy generation is token-identical to one process), in one process over the
local backend and across two processes over real sockets / UCX."""

from __future__ import annotations

import pytest
import torch

from halfmoon.engine.engine import Engine
from halfmoon.engine.kv_push import LayerPusher
from halfmoon.core.params import FinishReason
from halfmoon.core.params import SamplingParams
from tests.transport.helpers import peer_process
from halfmoon.transport import KVReceiver, KVSender, get_backend
from halfmoon.transport.errors import PeerLostError, TransportError
from halfmoon.transport.faults import FaultInjector

PROMPTS = [list(range(1000, 1000 + n)) for n in (5, 16, 40, 150)] + [[7, 8, 9] * 70]


@pytest.fixture(scope="module")
def pair(make_engine):  # noqa: ANN001, ANN201
    """(prefill engine, decode engine, sender, receiver) over the local backend."""
    prefill = make_engine(num_blocks=96, max_num_batched_tokens=64)  # small chunks: several pushes per prompt
    decode = make_engine(num_blocks=96)
    backend = get_backend("local")
    layout = prefill.kv_layout()
    receiver = KVReceiver(decode.kv_cache, layout, backend, timeout=10.0).start()
    sender = KVSender(prefill.kv_cache, layout, backend, receiver.address, timeout=10.0)
    yield prefill, decode, sender, receiver
    sender.close()
    receiver.close()


def disaggregated(prefill: Engine, decode: Engine, sender: KVSender, receiver: KVReceiver,
                  prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Every prompt's prefill pushed at once (one batch), then all decoded together."""
    rids = [f"d{i}-{len(p)}" for i, p in enumerate(prompts)]
    blocks = {}
    for rid, prompt in zip(rids, prompts):
        blocks[rid] = decode.reserve_blocks(len(prompt))
        receiver.expect(rid, blocks[rid])
        prefill.add_request(prompt, params, request_id=rid, kv_push=sender.open(rid, blocks[rid]))
    while prefill.has_unfinished():
        prefill.step()
    for rid, prompt in zip(rids, prompts):
        meta = receiver.wait(rid, 30).meta
        state = bytes.fromhex(meta["generator_state"]) if "generator_state" in meta else None
        decode.add_prefilled(prompt, meta["first_token"], params, blocks[rid], request_id=rid, generator_state=state)
    outputs: dict[str, list[int]] = {rid: [] for rid in rids}
    while decode.has_unfinished():
        for out in decode.step():
            outputs[out.request_id] += out.token_ids
    prefill.step()  # the prefill side releases blocks whose units have left
    return [outputs[rid] for rid in rids]


def assert_idle(*engines: Engine) -> None:
    for e in engines:
        e.pool.check_integrity()
        assert e.pool.num_free() == e.pool.num_blocks and not e.has_unfinished()


def test_greedy_is_token_identical_to_one_process(pair, shared_engine) -> None:  # noqa: ANN001
    prefill, decode, sender, receiver = pair
    params = SamplingParams(max_tokens=12, temperature=0)
    want = [r.output_ids for r in shared_engine.generate(PROMPTS, params)]
    assert disaggregated(prefill, decode, sender, receiver, PROMPTS, params) == want
    assert_idle(prefill, decode)


def test_seeded_sampling_continues_on_the_decode_side(pair, shared_engine) -> None:  # noqa: ANN001
    prefill, decode, sender, receiver = pair
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=1234)
    want = [r.output_ids for r in shared_engine.generate(PROMPTS[:3], params)]
    assert disaggregated(prefill, decode, sender, receiver, PROMPTS[:3], params) == want
    assert_idle(prefill, decode)


def test_each_layer_is_pushed_from_inside_the_forward_pass(pair) -> None:  # noqa: ANN001
    """The hook queues layer l's units before layer l+1 runs (not after the step)."""
    prefill, decode, sender, receiver = pair
    seen: list[tuple[int, int]] = []
    stream = sender.open("hooked", decode.reserve_blocks(40))
    receiver.expect("hooked", stream.dst_block_ids)
    real_call = LayerPusher.__call__

    def spy(self: LayerPusher, layer: int) -> None:
        real_call(self, layer)
        seen.append((layer, stream.units_submitted))

    prefill.add_request(list(range(2000, 2040)), SamplingParams(max_tokens=1), request_id="hooked", kv_push=stream)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LayerPusher, "__call__", spy)
        while prefill.has_unfinished():
            prefill.step()
    layers = prefill.model_config.num_layers
    assert seen == [(l, l + 1) for l in range(layers)]  # one step (40 < 64 tokens), one unit per layer
    assert receiver.wait("hooked", 30).num_units == layers
    decode.release_blocks(stream.dst_block_ids)
    prefill.step()
    assert_idle(prefill, decode)


def test_a_failed_push_aborts_the_request_and_frees_everything(make_engine) -> None:  # noqa: ANN001
    prefill = make_engine(num_blocks=32)
    dst = torch.zeros_like(prefill.kv_cache)
    backend = get_backend("tcp")
    layout = prefill.kv_layout()
    receiver = KVReceiver(dst, layout, backend, timeout=2.0).start()
    sender = KVSender(prefill.kv_cache, layout, backend, receiver.address, timeout=2.0)
    stream = sender.open("doomed", list(range(3)))
    receiver.close()  # the decode side goes away before the prefill starts
    prefill.add_request(list(range(3000, 3040)), SamplingParams(max_tokens=1), request_id="doomed", kv_push=stream)
    finals = []
    while prefill.has_unfinished():
        finals += [o for o in prefill.step() if o.finished]
    with pytest.raises(TransportError):
        stream.wait(5)
    assert finals and finals[0].end.finish_reason is FinishReason.ABORT
    prefill.step()
    assert_idle(prefill)
    sender.close()


class BreaksAtFinish:
    """A fake around a real push stream: the decode side went away after the last layer left,
    so `finish` raises as a reset connection does (the soak's kill-decode found this race)."""

    def __init__(self, stream) -> None:  # noqa: ANN001
        self.stream, self.cancelled = stream, False

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.stream, name)

    def finish(self, meta: dict | None = None) -> None:
        raise PeerLostError("receive from 127.0.0.1:1 failed: [Errno 104] Connection reset by peer")

    def cancel(self) -> None:
        self.cancelled = True
        self.stream.cancel()


def test_a_peer_lost_at_finish_fails_that_request_not_the_engine(make_engine) -> None:  # noqa: ANN001
    prefill = make_engine(num_blocks=32)
    dst = torch.zeros_like(prefill.kv_cache)
    backend = get_backend("tcp")
    layout = prefill.kv_layout()
    receiver = KVReceiver(dst, layout, backend, timeout=2.0).start()
    sender = KVSender(prefill.kv_cache, layout, backend, receiver.address, timeout=2.0)
    stream = BreaksAtFinish(sender.open("late", list(range(3))))
    prefill.add_request(list(range(4000, 4040)), SamplingParams(max_tokens=1), request_id="late", kv_push=stream)
    while prefill.has_unfinished():
        prefill.step()  # raised out of the step (and killed the engine loop) before the fix
    assert stream.cancelled
    with pytest.raises(TransportError):
        stream.wait(5)
    prefill.step()
    assert_idle(prefill)
    sender.close()
    receiver.close()


@pytest.mark.parametrize("name", ["tcp", "ucxx"])
def test_two_processes_token_identical(name: str, make_engine, shared_engine) -> None:  # noqa: ANN001
    """Prefill here, decode in another process that loads its own engine."""
    peer = peer_process("receiver", "--backend", name, "--engine")
    prefill = make_engine(num_blocks=96, max_num_batched_tokens=64)
    layout = prefill.kv_layout()
    sender = KVSender(prefill.kv_cache, layout, get_backend(name), peer.first["address"], timeout=30.0)
    try:
        params = SamplingParams(max_tokens=10, temperature=0)
        want = [r.output_ids for r in shared_engine.generate(PROMPTS, params)]
        for i, prompt in enumerate(PROMPTS):
            rid = f"x{i}"
            blocks = peer.ask(op="reserve", rid=rid, n=len(prompt))["blocks"]
            prefill.add_request(prompt, params, request_id=rid, kv_push=sender.open(rid, blocks))
            while prefill.has_unfinished():
                prefill.step()
            got = peer.ask(op="decode", rid=rid, prompt=prompt, max_tokens=10, timeout=30)
            assert got.get("output_ids") == want[i], got
        prefill.step()
        assert peer.ask(op="pool") == {"free": 256, "total": 256}
        assert_idle(prefill)
    finally:
        sender.close()
        peer.kill()


def test_preempted_prefill_still_pushes_identical_kv(make_engine, shared_engine) -> None:  # noqa: ANN001
    """A slow receiver keeps a finished request's blocks held (its units have not left) while the
    next prompt needs them: that request is preempted mid-prompt. The blocks it already pushed
    stay valid, the rest is pushed after the recompute, and the tokens are unchanged."""
    prefill = make_engine(num_blocks=10, max_num_batched_tokens=64)
    decode = make_engine(num_blocks=96)
    backend = get_backend("local")
    layout = prefill.kv_layout()
    slow = FaultInjector()
    slow.receive_delay = 0.03  # ~1 s for a chunk's 30 layer units: far longer than a step
    receiver = KVReceiver(decode.kv_cache, layout, backend, timeout=10.0, faults=slow).start()
    sender = KVSender(prefill.kv_cache, layout, backend, receiver.address, timeout=10.0)
    try:
        prompts = [list(range(4000 + 100 * i, 4000 + 100 * i + 90)) for i in range(3)]
        params = SamplingParams(max_tokens=8, temperature=0)
        want = [r.output_ids for r in shared_engine.generate(prompts, params)]
        assert disaggregated(prefill, decode, sender, receiver, prompts, params) == want
        assert prefill.scheduler.stats.preemptions > 0, "the test must exercise preemption"
        assert_idle(prefill, decode)
    finally:
        sender.close()
        receiver.close()


def test_closing_the_sender_mid_prefill_aborts_and_frees(make_engine) -> None:  # noqa: ANN001
    prefill = make_engine(num_blocks=32, max_num_batched_tokens=32)
    dst = torch.zeros_like(prefill.kv_cache)
    backend = get_backend("local")
    layout = prefill.kv_layout()
    receiver = KVReceiver(dst, layout, backend, timeout=5.0).start()
    sender = KVSender(prefill.kv_cache, layout, backend, receiver.address, timeout=5.0)
    try:
        receiver.expect("cut", list(range(7)))
        stream = sender.open("cut", list(range(7)))
        prefill.add_request(list(range(5000, 5100)), SamplingParams(max_tokens=1), request_id="cut", kv_push=stream)
        prefill.step()  # the first 32-token chunk is pushed
        sender.close()
        finals = []
        while prefill.has_unfinished():
            finals += [o for o in prefill.step() if o.finished]
        prefill.step()
        assert finals and finals[0].end.finish_reason is FinishReason.ABORT
        with pytest.raises(TransportError):
            stream.wait(1)
        assert_idle(prefill)
    finally:
        receiver.close()
