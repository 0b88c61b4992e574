"""Only the native part of the build; everything else is in pyproject.toml.

Four small C extensions, each `optional`: without a C compiler and the Python headers the
install still succeeds and the module that would use one logs a warning at import:
- kvpool._copysum (kvpool/_copysum.c): a fused copy + checksum of KV blocks; without it the
  tiers run on the slower numpy path.
- transport._ucxspin (transport/_ucxspin.c): progresses the UCX worker without the GIL while
  transfers are in flight; without it the ucxx backend sleeps on the worker's event fd between
  fragments (about half the throughput).
- kernels._paged_attn (kernels/_paged_attn.c): decode attention that reads the paged KV cache in
  place; without it the torch backend gathers every request's blocks into a copy first (slower).
- kernels._qgemv (kernels/_qgemv.c): int4 (Q4_1) / int8 weight-only products for decode's few
  rows with integer dot products, and bf16-weight ones; without it `--quantization int4|int8`
  runs torch's slower kernels (kernels/quant_linear.py), and bf16 on a CPU without oneDNN's
  bf16 path `F.linear` (kernels/linear.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("kvpool._copysum", ["kvpool/_copysum.c"], extra_compile_args=["-O3", "-std=c11"],
              optional=True),
    Extension("transport._ucxspin", ["transport/_ucxspin.c"],
              extra_compile_args=["-O2", "-std=gnu11"], optional=True),
    Extension("kernels._paged_attn", ["kernels/_paged_attn.c"],
              extra_compile_args=["-O3", "-std=gnu11", "-fopenmp"], extra_link_args=["-fopenmp"],
              optional=True),
    Extension("kernels._qgemv", ["kernels/_qgemv.c"], extra_compile_args=["-O3", "-std=c11", "-fno-math-errno", "-fopenmp"],
              extra_link_args=["-fopenmp"], optional=True),
])
