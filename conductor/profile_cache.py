"""Cost models measured once per machine and engine shape, then read back at every start.

A quick profile takes tens of seconds on a CPU; the numbers depend only on the model, dtype, block
size, thread count, the machine and the torch build, so they are kept in
`$HALFMOON_CACHE_DIR/profiles/<key>.json` (default `~/.cache/halfmoon`) under a key hashed from
those. `halfmoon profile` (a full grid) or `--cost-model FILE` is still the way to pin one.
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Awaitable, Callable
from pathlib import Path

from conductor.cost_model import CostModel
from core.cache_dir import cache_key, cache_root
from core.errors import ConfigError
from core.messages import EngineInfo

log = logging.getLogger(__name__)

def cache_dir() -> Path:
    return cache_root() / "profiles"


def profile_key(info: EngineInfo, threads: int | None) -> str:
    """What the measured times depend on, hashed (sha256, canonical JSON)."""
    import torch

    shape = {"fingerprint": info.fingerprint, "dtype": info.dtype, "block_size": info.block_size,
             "threads": threads or os.cpu_count(), "cpu": _cpu_model(), "cores": os.cpu_count(),
             "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    return cache_key(shape)


async def cached_cost_model(key: str, measure: Callable[[], Awaitable[CostModel]]) -> CostModel:
    """The cost model stored under `key`, else `measure()`d and stored (atomically)."""
    path = cache_dir() / f"{key}.json"
    if path.exists():
        try:
            model = CostModel.load(path)
            log.info("cost model from the profile cache: %s", path)
            return model
        except ConfigError as e:
            log.warning("ignoring an unreadable cached profile (%s); measuring again", e)
    log.warning("no cost model given and none cached: profiling (quick); cached at %s for next time", path)
    model = await measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        model.save(tmp)
        tmp.replace(path)
    except OSError as e:
        log.warning("could not cache the profile at %s: %s", path, e)
    return model


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
