"""A transport peer in its own process, driven by JSON lines on stdin/stdout (tests only).

    python -m tests.transport.peer receiver --backend tcp [--engine] [--secret S]
        prints {"address": ...}; then ops:
        {"op": "expect", "rid": R, "blocks": [...]}              -> {"ok": true}
        {"op": "reserve", "rid": R, "n": tokens}  (--engine)      -> {"blocks": [...]}
        {"op": "wait", "rid": R, "timeout": s}                   -> {"ok": true, "meta": ...} | {"error": type}
        {"op": "decode", "rid": R, "prompt": [...], "max_tokens": k, "timeout": s} (--engine)
                                                                  -> {"output_ids": [...]} | {"error": type}
        {"op": "pool"} (--engine)                                 -> {"free": n, "total": n}
        {"op": "digest", "blocks": [...]}                         -> {"sha": hex of those blocks' bytes}
    python -m tests.transport.peer sender --backend tcp --address A --rid R --blocks N
        sends one big unit (all layers of N blocks) forever-ish until killed; prints {"sending": true}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import torch

from halfmoon.transport import KVLayout, KVReceiver, KVSender, get_backend

# A small synthetic layout (no model) for raw transport peers: 4 KB per block per layer.
RAW_SHAPE = (2, 2, 4096, 16, 1, 32)
RAW_FINGERPRINT = "raw-test-layout"


def reply(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def raw_kv(seed: int | None) -> torch.Tensor:
    if seed is None:
        return torch.zeros(RAW_SHAPE)
    return torch.randn(RAW_SHAPE, generator=torch.Generator().manual_seed(seed))


def run_receiver(args: argparse.Namespace) -> None:
    engine = None
    if args.engine:
        from halfmoon.engine.config import EngineConfig
        from halfmoon.engine.engine import Engine

        engine = Engine(EngineConfig(model="smollm2", dtype="float32", num_threads=1, num_blocks=256))
        kv, layout = engine.kv_cache, engine.kv_layout()
    else:
        kv = raw_kv(None)
        layout = KVLayout.of(kv, RAW_FINGERPRINT)
    secret = args.secret.encode() if args.secret else None
    receiver = KVReceiver(kv, layout, get_backend(args.backend), secret=secret, timeout=5.0).start()
    reply({"address": receiver.address})
    reserved: dict[str, list[int]] = {}
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg["op"]
        if op == "quit":
            break
        reply(handle(op, msg, receiver, engine, kv, reserved))
    receiver.close()


def handle(op: str, msg: dict, receiver: KVReceiver, engine, kv: torch.Tensor,  # noqa: ANN001
           reserved: dict[str, list[int]]) -> dict:
    if op == "expect":
        receiver.expect(msg["rid"], msg["blocks"])
        return {"ok": True}
    if op == "reserve":
        blocks = reserved[msg["rid"]] = engine.reserve_blocks(msg["n"])
        receiver.expect(msg["rid"], blocks)
        return {"blocks": blocks}
    if op == "wait":
        try:
            return {"ok": True, "meta": receiver.wait(msg["rid"], msg["timeout"]).meta}
        except Exception as e:  # reported to the test, which asserts on the type
            return {"error": type(e).__name__, "message": str(e)}
    if op == "decode":
        return decode(msg, receiver, engine, reserved)
    if op == "pool":
        engine.pool.check_integrity()
        return {"free": engine.pool.num_free(), "total": engine.pool.num_blocks}
    if op == "digest":
        return {"sha": hashlib.sha256(kv[:, :, msg["blocks"]].numpy().tobytes()).hexdigest()}
    return {"error": "UnknownOp"}


def decode(msg: dict, receiver: KVReceiver, engine, reserved: dict[str, list[int]]) -> dict:  # noqa: ANN001
    from halfmoon.core.params import SamplingParams

    rid = msg["rid"]
    blocks = reserved.pop(rid)
    try:
        result = receiver.wait(rid, msg["timeout"])
    except Exception as e:  # the transfer failed: the reserved blocks go back
        engine.release_blocks(blocks)
        return {"error": type(e).__name__, "message": str(e)}
    params = SamplingParams(max_tokens=msg["max_tokens"], temperature=0)
    engine.add_prefilled(msg["prompt"], result.meta["first_token"], params, blocks, request_id=rid)
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.token_ids
    return {"output_ids": out}


def run_sender(args: argparse.Namespace) -> None:
    kv = raw_kv(1)
    layout = KVLayout.of(kv, RAW_FINGERPRINT)
    sender = KVSender(kv, layout, get_backend(args.backend), args.address, timeout=5.0)
    stream = sender.open(args.rid, list(range(args.blocks)))
    reply({"sending": True})
    for _ in range(1000):  # the test kills us long before this ends
        for layer in range(layout.num_layers):
            stream.send_layer(layer, list(range(args.blocks)), list(range(args.blocks)))
        time.sleep(0.01)  # the thing under test: a sender still sending when killed (paced)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["receiver", "sender"])
    ap.add_argument("--backend", default="tcp")
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--secret")
    ap.add_argument("--address")
    ap.add_argument("--rid")
    ap.add_argument("--blocks", type=int, default=1024)
    args = ap.parse_args()
    run_receiver(args) if args.role == "receiver" else run_sender(args)


if __name__ == "__main__":
    main()
