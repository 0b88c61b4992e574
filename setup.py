"""Only the native part of the build; everything else is in pyproject.toml.

kvpool._copysum (a fused copy + checksum of KV blocks, kvpool/_copysum.c) needs a C compiler
and the Python headers. It is `optional`: without them the install still succeeds and
kvpool.checksum logs a warning at import that the tiers run on the slower numpy path.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvpool._copysum", ["kvpool/_copysum.c"],
                             extra_compile_args=["-O3", "-std=c11"], optional=True)])
