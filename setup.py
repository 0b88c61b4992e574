"""Only the native part of the build; everything else is in pyproject.toml.

Five small C extensions, each `optional`: without a C compiler and the Python headers the
install still succeeds and the module that would use one logs a warning at import:
- halfmoon.kvpool._copysum (halfmoon/kvpool/_copysum.c): a fused copy + checksum of KV blocks; without it the
  tiers run on the slower numpy path.
- halfmoon.transport._ucxspin (halfmoon/transport/_ucxspin.c): progresses the UCX worker without the GIL while
  transfers are in flight; without it the ucxx backend sleeps on the worker's event fd between
  fragments (about half the throughput).
- halfmoon.kernels._paged_attn (halfmoon/kernels/_paged_attn.c): decode attention that reads the paged KV cache in
  place, and for all-decode steps RoPE + the KV write in the same call; without it the torch
  backend gathers every request's blocks into a copy first (slower).
- halfmoon.kernels._fused (halfmoon/kernels/_fused.c): a decode step's residual add + RMSNorm and SiLU(gate) * up
  (and a grammar's token mask on the logits, kernels/token_mask.py),
  one call each; without it (or without _paged_attn) every decode step runs the torch ops of
  engine/model.py's `_layer` (about 3x the per-layer calls; kernels/fused.py).
- halfmoon.kernels._qgemv (halfmoon/kernels/_qgemv.c): int4 (Q4_1) / int8 weight-only products for decode's few
  rows with integer dot products, and bf16-weight ones; without it `--quantization int4|int8`
  runs torch's slower kernels (kernels/quant_linear.py), and bf16 on a CPU without oneDNN's
  bf16 path `F.linear` (kernels/linear.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("halfmoon.kvpool._copysum", ["halfmoon/kvpool/_copysum.c"], extra_compile_args=["-O3", "-std=c11"],
              optional=True),
    Extension("halfmoon.transport._ucxspin", ["halfmoon/transport/_ucxspin.c"],
              extra_compile_args=["-O2", "-std=gnu11"], optional=True),
    Extension("halfmoon.kernels._paged_attn", ["halfmoon/kernels/_paged_attn.c"],
              extra_compile_args=["-O3", "-std=gnu11", "-fopenmp"], extra_link_args=["-fopenmp"],
              optional=True),
    # no-trapping-math lets the vectorizer if-convert e^x's clamp (no change to any result)
    Extension("halfmoon.kernels._fused", ["halfmoon/kernels/_fused.c"],
              extra_compile_args=["-O3", "-std=gnu11", "-fno-math-errno", "-fno-trapping-math",
                                  "-fopenmp"],
              extra_link_args=["-fopenmp"], optional=True),
    Extension("halfmoon.kernels._qgemv", ["halfmoon/kernels/_qgemv.c"], extra_compile_args=["-O3", "-std=c11", "-fno-math-errno", "-fopenmp"],
              extra_link_args=["-fopenmp"], optional=True),
])
