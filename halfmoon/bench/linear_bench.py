"""`halfmoon bench linear`: packed oneDNN linear (kernels/linear.py) vs plain `F.linear`.

SmolLM2's fused gate/up shape ([3072, 576]) x 20 weights, for batch sizes 1..512, fp32 and bf16,
both kernels in the same run; prints GB/s of weights read, GFLOP/s and the ratio.

`--quantized` (issue 23): the same weights as the weight-only kernels of kernels/quant_linear.py
(int8 per channel, int4 in groups of 32; torch's kernels and the native kernels._qgemv, bf16
activations, each at every row count), the int4 layer's dequantized fp32 copy (what a layer
runs from DENSE_MIN_ROWS rows on, here at every row count) and the packed
fp32 layer: microseconds per weight (all 20) and GB/s of the weight bytes a call reads. With
them the bf16 weights as a CPU without oneDNN's bf16 path runs them (kernels/linear.py): `F.linear`
on the plain weight ("bf16 plain"), the "bf16-native" layer's C kernel and its packed fp32 copy
(what it runs below / from BF16_DENSE_MIN_ROWS rows), each at every row count.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from halfmoon.kernels.linear import NATIVE_KERNEL, Linear, onednn_available
from halfmoon.kernels.quant_linear import Int4Linear, Int8Linear

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


QUANTIZED_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 64, 256)


def quantized_kinds(weights: list[torch.Tensor]) -> dict[str, tuple[list[Callable[[torch.Tensor], torch.Tensor]],
                                                                      torch.dtype, int]]:
    """name -> (the 20 layers' calls, activation dtype, bytes of weight one call reads)."""
    int8 = {native: [Int8Linear(w, native=native) for w in weights] for native in (False, True) if native <= NATIVE_KERNEL}
    int4 = {native: [Int4Linear.from_float(w, native=native) for w in weights]
            for native in (False, True) if native <= NATIVE_KERNEL}
    dense = [Linear(w) for w in weights]
    kinds = {"fp32 packed": ([lin.__call__ for lin in dense], torch.float32, sum(lin.nbytes() for lin in dense))}
    for name, layers in (("int8", int8), ("int4", int4)):
        for native, group in layers.items():
            label = f"{name} {'native' if native else 'torch'}"
            kinds[label] = ([lin.few_rows for lin in group], torch.bfloat16, sum(lin.nbytes() for lin in group))
    # the dequantized copy as the layers keep it (built at the first many-row call)
    kinds["int4 dense copy"] = ([lambda x, lin=lin: lin.dense_rows(x) for lin in int4[max(int4)]], torch.bfloat16,
                                sum(lin.nbytes() for lin in dense))
    bf16 = [w.bfloat16() for w in weights]
    nbytes = sum(w.numel() * 2 for w in bf16)
    kinds["bf16 plain"] = ([lambda x, w=w: F.linear(x, w) for w in bf16], torch.bfloat16, nbytes)
    if NATIVE_KERNEL:
        native = [Linear(w, "bf16-native") for w in bf16]
        kinds["bf16 native"] = ([lin.few_rows for lin in native], torch.bfloat16, nbytes)
        kinds["bf16 dense copy"] = ([lin.dense_rows for lin in native], torch.bfloat16, 2 * nbytes)  # fp32
    return kinds


def quantized_rows(weights: list[torch.Tensor], repeats: int) -> list[dict[str, object]]:
    """us per call and weight GB/s of each kind of layer, per batch size (bf16 activations for
    the quantized layers, as the engine runs them)."""
    kinds = quantized_kinds(weights)
    rows: list[dict[str, object]] = []
    for batch in QUANTIZED_BATCH_SIZES:
        for kind, (layers, act, nbytes) in kinds.items():
            x = torch.randn(batch, weights[0].shape[1], dtype=act)
            ms = best_ms(lambda: [lin(x) for lin in layers], repeats)  # noqa: B023 (called here)
            rows.append({"kind": kind, "batch": batch, "us_per_weight": ms * 1e3 / len(layers),
                         "gbps": nbytes / ms / 1e6})
    return rows


def print_quantized(rows: list[dict[str, object]]) -> None:
    print(f"linear [3072x576] x20, {torch.get_num_threads()} threads: us per weight (weight GB/s)")
    kinds = list(dict.fromkeys(str(r["kind"]) for r in rows))
    print(f"{'M':>4} " + " ".join(f"{k:>18}" for k in kinds))
    for batch in QUANTIZED_BATCH_SIZES:
        found = {r["kind"]: r for r in rows if r["batch"] == batch}
        cells = [f"{found[k]['us_per_weight']:>9.0f} ({found[k]['gbps']:>5.1f})" if k in found else "-"
                 for k in kinds]
        print(f"{batch:>4} " + " ".join(f"{c:>18}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="halfmoon bench linear", description=__doc__)
    p.add_argument("--json", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quantized", action="store_true",
                   help="int8/int4 weight-only kernels and the bf16 kinds (issue 23)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not onednn_available():
        print("halfmoon bench linear: this torch build has no oneDNN linear ops", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quantized:
        qrows = quantized_rows([torch.randn(3072, 576) * 0.05 for _ in range(20)], args.repeats)
        if args.json:
            print(json.dumps({"threads": torch.get_num_threads(), "rows": qrows}, indent=2))
        else:
            print_quantized(qrows)
        return 0
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
