"""`halfmoon bench linear`: packed oneDNN linear (kernels/linear.py) vs plain `F.linear`.

SmolLM2's fused gate/up shape ([3072, 576]) x 20 weights, for batch sizes 1..512, fp32 and bf16,
both kernels in the same run; prints GB/s of weights read, GFLOP/s and the ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.linear import Linear, onednn_available

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 512)


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def measure(dtype: torch.dtype, batch: int, weights: list[torch.Tensor], repeats: int) -> dict[str, float]:
    packed = [Linear(w, "onednn") for w in weights]
    x = torch.randn(batch, weights[0].shape[1], dtype=dtype)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flops = 2 * batch * sum(w.numel() for w in weights)
    plain_ms = best_ms(lambda: [F.linear(x, w) for w in weights], repeats)
    packed_ms = best_ms(lambda: [lin(x) for lin in packed], repeats)
    return {"dtype": str(dtype).removeprefix("torch."), "batch": batch,
            "plain_gbps": nbytes / plain_ms / 1e6, "packed_gbps": nbytes / packed_ms / 1e6,
            "plain_gflops": flops / plain_ms / 1e6, "packed_gflops": flops / packed_ms / 1e6,
            "speedup": plain_ms / packed_ms}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="halfmoon bench linear", description=__doc__)
    p.add_argument("--json", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not onednn_available():
        print("halfmoon bench linear: this torch build has no oneDNN linear ops", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    dtypes = [d for d in (torch.float32, torch.bfloat16) if onednn_available(d)]
    if len(dtypes) < 2:
        print("halfmoon bench linear: this CPU has no oneDNN bf16 path: fp32 only", file=sys.stderr)
    for dtype in dtypes:
        weights = [torch.randn(3072, 576).to(dtype) for _ in range(20)]
        rows += [measure(dtype, b, weights, args.repeats) for b in BATCH_SIZES]
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=2))
        return 0
    print(f"linear [3072x576] x20, {torch.get_num_threads()} threads: plain F.linear vs packed oneDNN")
    print(f"{'dtype':9} {'M':>4} {'plain GB/s':>11} {'packed GB/s':>12} {'plain GF/s':>11} "
          f"{'packed GF/s':>12} {'ratio':>6}")
    for r in rows:
        print(f"{r['dtype']:9} {r['batch']:>4} {r['plain_gbps']:>11.1f} {r['packed_gbps']:>12.1f} "
              f"{r['plain_gflops']:>11.0f} {r['packed_gflops']:>12.0f} {r['speedup']:>5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
