"""Dequantized GGUF weights kept on disk and memory-mapped back: a worker's start without the
dequantization.

Turning the Q4 GGUF into fp32 (or bf16) tensors is most of a model load on a CPU. The result
depends only on the file, the dtype and this loader's code, so it is written once to
`$HALFMOON_CACHE_DIR/weights/<key>.pt` (default `~/.cache/halfmoon`; the key hashes the file's
path, size and mtime, the dtype, the `gguf` package's version and `LAYOUT_VERSION`) and read back
with `torch.load(mmap=True)`: the pages come from the page cache, shared by every process of the
machine that loads the same model (copy-on-write, so nothing one engine does reaches another).

Failures are loud, never fatal: an unreadable entry is logged, removed and rebuilt; a cache
that cannot be written is logged and the weights are served from memory.
`HALFMOON_WEIGHTS_CACHE=0` turns it off (the weights are then dequantized at every load).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import torch

from halfmoon.core.cache_dir import cache_key, cache_root

log = logging.getLogger(__name__)

ENABLE_ENV = "HALFMOON_WEIGHTS_CACHE"
# Bump when what the loader produces from the same file changes (names, layouts, unpermuting;
# 2: per-arch names, Gemma norms stored as HF's w).
LAYOUT_VERSION = 2
# Entries kept (the least recently used beyond it are removed when one is stored): a model in a
# dtype or two, and room for another file.
MAX_ENTRIES = 4
PAGE_BYTES = 4096

Weights = dict[str, torch.Tensor]


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def entry_path(source: Path, dtype: torch.dtype) -> Path:
    """Where the weights of `source` as `dtype` are cached."""
    st = source.stat()
    try:
        gguf_version = metadata.version("gguf")
    except metadata.PackageNotFoundError:
        gguf_version = "?"
    shape = {"path": str(source.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "dtype": str(dtype),
             "gguf": gguf_version, "layout": LAYOUT_VERSION}
    return cache_root() / "weights" / f"{cache_key(shape)}.pt"


def cached_weights(source: Path, dtype: torch.dtype, build: Callable[[], Weights],
                   lazy: frozenset[str] = frozenset()) -> Weights:
    """The weights of `source` from the cache (memory-mapped), else `build()` and store them.
    `lazy`: names the caller will not read (an int4 engine's layers come from the file's own
    4-bit blocks): their pages are not prefaulted, so they stay on disk unless touched."""
    if not enabled():
        return build()
    path = entry_path(source, dtype)
    if path.exists():
        weights = _read(path, lazy)
        if weights is not None:
            return weights
    weights = build()
    _write(path, weights)
    return weights


def _read(path: Path, lazy: frozenset[str]) -> Weights | None:
    t0 = time.perf_counter()
    try:
        weights = torch.load(path, mmap=True, weights_only=True)
        if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
            raise ValueError("not a dict of tensors")
    except (OSError, RuntimeError, ValueError, EOFError) as e:  # torch raises RuntimeError for a bad zip
        log.warning("weights cache: unreadable entry %s (%s): removing it and dequantizing again", path, e)
        path.unlink(missing_ok=True)
        return None
    _prefault({name: t for name, t in weights.items() if name not in lazy})
    log.info("weights cache: %d tensors memory-mapped from %s in %.2f s (%d not prefaulted)", len(weights), path,
             time.perf_counter() - t0, len(lazy & weights.keys()))
    _touch(path)
    return weights


def _prefault(weights: Weights) -> None:
    """Read one element of every page now: a mapped tensor otherwise pages in as it is first
    used (an embedding row per new token id), which reads as memory growth under load."""
    for t in weights.values():
        if t.numel():
            stride = max(1, PAGE_BYTES // t.element_size())
            t.reshape(-1)[::stride].sum()


def _touch(path: Path) -> None:
    with contextlib.suppress(OSError):  # a read-only cache still serves
        os.utime(path)  # its mtime is its last use: what pruning keeps


def _write(path: Path, weights: Weights) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(weights, tmp)
        tmp.replace(path)  # atomic: a concurrent reader sees the whole file or none
        log.info("weights cache: stored %s", path)
        _prune(path.parent)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        log.warning("weights cache: could not store %s (%s); every load dequantizes again", path, e)


def _prune(folder: Path) -> None:
    """Remove the least recently used entries beyond `MAX_ENTRIES` (a process that mapped one
    keeps its pages: unlinking does not unmap)."""
    entries = sorted(folder.glob("*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[MAX_ENTRIES:]:
        old.unlink(missing_ok=True)
        log.info("weights cache: removed the least recently used %s", old)
