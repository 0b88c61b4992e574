"""What sliding windows save in transit: `python -m halfmoon.bench.window_bench [--model gemma3-270m] [--tokens 2000]`.

A prompt is prefilled by one engine pushing its KV layer by layer to a second engine (the local
transport backend); the push stream's record of units gives the bytes sent, against the bytes
of every layer's every block (what a model without windows sends). The decode side then decodes
16 tokens, checked equal to one engine's greedy tokens (the cut blocks were never needed).
"""

from __future__ import annotations

import argparse
import sys

import torch

from halfmoon.core.params import SamplingParams
from halfmoon.engine import quality
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.transport import KVReceiver, KVSender, get_backend

NEW = 16


def measure(model: str, tokens: int, threads: int) -> dict[str, float | int | bool]:
    torch.set_num_threads(threads)
    cfg = EngineConfig(model=model, num_blocks=tokens // 16 + 64, num_threads=threads, dtype="bfloat16",
                       max_num_batched_tokens=512)
    prefill, decode = Engine(cfg), Engine(cfg)
    layout, backend = prefill.kv_layout(), get_backend("local")
    receiver = KVReceiver(decode.kv_cache, layout, backend, timeout=60).start()
    sender = KVSender(prefill.kv_cache, layout, backend, receiver.address, timeout=60)
    ids = prefill.tokenizer.encode("\n\n".join([quality.QUALITY_TEXT] * (tokens // 100 + 1)))[:tokens]
    blocks = -(-len(ids) // 16)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    try:
        dst = decode.reserve_blocks(len(ids) + NEW)
        receiver.expect("r", dst[:blocks])
        stream = sender.open("r", dst[:blocks], record=True)
        prefill.add_request(ids, params, request_id="r", kv_push=stream)
        while prefill.has_unfinished():
            prefill.step()
        meta = receiver.wait("r", 120).meta
        decode.add_prefilled(ids, meta["first_token"], params, dst, request_id="r")
        out: list[int] = []
        while decode.has_unfinished():
            for chunk in decode.step():
                out += chunk.token_ids
    finally:
        sender.close()
        receiver.close()
    sent = sum(u.nbytes for u in stream.log or [])
    full = blocks * layout.num_layers * layout.unit_bytes(1)
    reference = Engine(cfg).generate([ids], params)[0].output_ids
    return {"prompt_tokens": len(ids), "blocks": blocks, "layers": layout.num_layers,
            "sent_bytes": sent, "unwindowed_bytes": full, "fraction": sent / full, "identical": out == reference}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m halfmoon.bench.window_bench")
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    r = measure(args.model, args.tokens, args.threads)
    print(f"{args.model}: prompt {r['prompt_tokens']} tokens, {r['blocks']} blocks, {r['layers']} layers: sent "
          f"{r['sent_bytes'] / 1e6:.2f} MB of {r['unwindowed_bytes'] / 1e6:.2f} MB = {r['fraction']:.1%}; "
          f"decode after the windowed transfer identical to one engine: {r['identical']}")
    return 0 if r["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
