"""The receiving process of `halfmoon bench transport` (driven by JSON lines on stdin).

    python -m halfmoon.bench.transport_peer kv --backend tcp --shape L,2,N,B,H,D --dtype float32 --fingerprint F
        prints {"address": A}; ops: {"op": "expect", "rids": [...], "blocks": [...]} -> {"ok": true}
                                    {"op": "wait", "rids": [...], "timeout": s}   -> {"ok": true} | {"error": ...}
    python -m halfmoon.bench.transport_peer send --backend tcp --shape ... --address A --plan JSON
        the sending side: plan = [[size, rounds, [rid, ...], [block, ...]], ...]; for each size the
        first rid warms up, the rest go out back to back in `rounds` equal rounds; prints
        {"gbps": {size: GB/s of the best round}}
    python -m halfmoon.bench.transport_peer chan --nbytes N --count C [--no-hash]
        the checksummed-channel reference: a ucxx channel alone (no KV protocol), receiving C
        units of N bytes into one buffer, cut into the protocol's frames, xxh3-64 over each frame
        as it lands, then a 1-byte ack; prints {"address": A}
    python -m halfmoon.bench.transport_peer chansend --address A --nbytes N --count C [--no-hash]
        its sending side (xxh3-64 over each frame before it goes out); prints {"gbps": GB/s}
    python -m halfmoon.bench.transport_peer socket --nbytes N --count C
        the raw baseline: plain sockets, `recv_into` one preallocated buffer C times, then a 1-byte ack;
        prints {"port": P}
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch


def reply(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def run_kv(args: argparse.Namespace) -> None:
    from halfmoon.transport import KVLayout, KVReceiver, get_backend

    shape = tuple(int(x) for x in args.shape.split(","))
    kv = torch.zeros(shape, dtype=getattr(torch, args.dtype))
    receiver = KVReceiver(kv, KVLayout.of(kv, args.fingerprint), get_backend(args.backend), timeout=60.0).start()
    reply({"address": receiver.address})
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "expect":
            for rid in msg["rids"]:
                receiver.expect(rid, msg["blocks"])
            reply({"ok": True})
        elif msg["op"] == "wait":
            try:
                for rid in msg["rids"]:
                    receiver.wait(rid, msg["timeout"])
                reply({"ok": True})
            except Exception as e:  # reported to the bench, which prints it
                reply({"error": f"{type(e).__name__}: {e}"})
        else:
            break
    receiver.close()


def run_send(args: argparse.Namespace) -> None:
    from halfmoon.transport import KVLayout, KVSender, get_backend

    shape = tuple(int(x) for x in args.shape.split(","))
    kv = torch.randn(shape).to(getattr(torch, args.dtype))
    sender = KVSender(kv, KVLayout.of(kv, args.fingerprint), get_backend(args.backend), args.address,
                      timeout=120.0, max_inflight_bytes=512 << 20)
    rates = {}
    for size, rounds, rids, blocks in json.loads(args.plan):
        send_round(sender, rids[:1], blocks)
        per_round = (len(rids) - 1) // rounds
        best = 0.0
        for r in range(rounds):
            start = time.perf_counter()
            send_round(sender, rids[1 + r * per_round : 1 + (r + 1) * per_round], blocks)
            best = max(best, per_round * size / (time.perf_counter() - start) / 1e9)
        rates[size] = best
    sender.close()
    reply({"gbps": rates})


def send_round(sender, rids: list[str], blocks: list[int]) -> None:  # noqa: ANN001
    """Every request's unit queued back to back, then every confirmation awaited."""
    streams = []
    for rid in rids:
        stream = sender.open(rid, blocks)
        stream.send_layer(0, blocks, blocks)
        stream.finish()
        streams.append(stream)
    for stream in streams:
        stream.wait(120)


def run_socket(args: argparse.Namespace) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    reply({"port": server.getsockname()[1]})
    conn, _ = server.accept()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    buf = memoryview(bytearray(args.nbytes))
    for _ in range(args.count):
        got = 0
        while got < args.nbytes:
            n = conn.recv_into(buf[got:])
            if n == 0:
                return
            got += n
    conn.sendall(b"k")
    conn.close()
    server.close()


def _unit_frames(nbytes: int) -> tuple[bytearray, list[list[memoryview]]]:
    """One unit's buffer, cut into frames the way the KV protocol cuts a one-view payload."""
    from halfmoon.transport.frames import split_frames
    from halfmoon.transport.protocol import FRAME_BYTES

    buf = (bytearray(os.urandom(1024)) * (nbytes // 1024 + 1))[:nbytes]
    return buf, list(split_frames([memoryview(buf)], FRAME_BYTES))


def _hasher(frames: list[list[memoryview]], on: bool):  # noqa: ANN202
    """A per-frame callback feeding frame i to an xxh3-64 (or nothing when not `on`)."""
    from halfmoon.transport.frames import new_hash

    h = new_hash()
    return (lambda i: h.update(frames[i][0])) if on else None


def run_chan(args: argparse.Namespace) -> None:
    from halfmoon.transport import get_backend

    listener = get_backend("ucxx").listen("127.0.0.1", 0)
    reply({"address": listener.address})
    channel = listener.accept(60)
    _, unit = _unit_frames(args.nbytes)
    frames = unit * args.count  # one call, so receives stay posted ahead across units
    channel.recv_many(frames, 60, _hasher(frames, args.hash))
    channel.sendv([memoryview(b"k")], 30)
    time.sleep(0.5)  # let the ack leave before the endpoint closes
    channel.close()
    listener.close()


def run_chansend(args: argparse.Namespace) -> None:
    from halfmoon.transport import get_backend

    channel = get_backend("ucxx").connect(args.address, 60)
    _, unit = _unit_frames(args.nbytes)
    channel.send_many(unit, 60, _hasher(unit, args.hash))  # warm-up
    frames = unit * (args.count - 1)
    start = time.perf_counter()
    channel.send_many(frames, 60, _hasher(frames, args.hash))
    channel.recv_into([memoryview(bytearray(1))], 60)
    reply({"gbps": (args.count - 1) * args.nbytes / (time.perf_counter() - start) / 1e9})
    channel.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["kv", "send", "socket", "chan", "chansend"])
    ap.add_argument("--address")
    ap.add_argument("--plan")
    ap.add_argument("--backend", default="tcp")
    ap.add_argument("--shape")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--fingerprint", default="bench")
    ap.add_argument("--nbytes", type=int)
    ap.add_argument("--count", type=int)
    ap.add_argument("--no-hash", dest="hash", action="store_false")
    args = ap.parse_args()
    modes = {"kv": run_kv, "send": run_send, "socket": run_socket, "chan": run_chan, "chansend": run_chansend}
    modes[args.mode](args)


if __name__ == "__main__":
    main()
