"""Cost models measured once per machine and engine shape, then read back at every start.

A quick profile takes tens of seconds on a CPU; the numbers depend on the model, dtype, the
engine's shape (block size, step budget, how many prompts a step packs, speculation, tensor
parallelism, ...), the grid measured, the thread count, the machine and the torch build, so they
are kept in `$HALFMOON_CACHE_DIR/profiles/<key>.json` (default `~/.cache/halfmoon`) under a key
hashed from all of those and from `PROFILE_FORMAT`. An entry that cannot be read, or reads as a
model no engine could have (a prediction that is not a positive number), is measured again,
never trusted. `halfmoon profile` (a full grid) or `--cost-model FILE` is still the way to pin one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
import platform
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from halfmoon.conductor.cost_model import CostModel, fit_profile
from halfmoon.core.cache_dir import cache_key, cache_root
from halfmoon.core.errors import ConfigError
from halfmoon.core.messages import EngineInfo
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.profiling import QUICK_GRID, ProfileGrid

if TYPE_CHECKING:
    from halfmoon.conductor.workers import Worker as ProfiledWorker

log = logging.getLogger(__name__)

def cache_dir() -> Path:
    return cache_root() / "profiles"


# Bump when what a profile holds, or how it is measured, changes: every older entry is then
# measured again (2: decode points sized by the engine's own packing; the shape and grid keyed).
PROFILE_FORMAT = 2
# The EngineConfig fields the measured times depend on (beyond the model, dtype and threads).
SHAPE_FIELDS = ("block_size", "quantization", "max_num_batched_tokens", "max_num_seqs",
                "max_prefill_seqs", "max_model_len", "attention_backend", "speculative",
                "speculative_tokens", "speculative_max_batch", "tp", "device", "cuda_graphs")


def profile_key(info: EngineInfo, config: EngineConfig, grid: ProfileGrid = QUICK_GRID) -> str:
    """What the measured times depend on, hashed (sha256, canonical JSON)."""
    import torch

    threads = config.num_threads or os.cpu_count()
    shape = {"format": PROFILE_FORMAT, "fingerprint": info.fingerprint, "dtype": info.dtype,
             "engine": {name: getattr(config, name) for name in SHAPE_FIELDS},
             "grid": dataclasses.asdict(grid), "threads": threads, "cpu": _cpu_model(),
             "cores": os.cpu_count(), "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    return cache_key(shape)


def _trusted(model: CostModel) -> CostModel:
    """`model` when it predicts like a measured engine (positive, finite times), else ConfigError."""
    times = (model.est_prefill_ms(64), model.est_prefill_ms(512), model.est_decode_step_ms(1, 128))
    if not all(math.isfinite(x) and x > 0 for x in times):
        raise ConfigError(f"predicts impossible times {times}")
    return model


async def cached_cost_model(key: str, measure: Callable[[], Awaitable[CostModel]]) -> CostModel:
    """The cost model stored under `key`, else `measure()`d and stored (atomically)."""
    path = cache_dir() / f"{key}.json"
    if path.exists():
        try:
            model = _trusted(CostModel.load(path))
            log.info("cost model from the profile cache: %s", path)
            return model
        except ConfigError as e:
            log.warning("ignoring an unreadable cached profile (%s); measuring again", e)
    log.warning("no cost model given and none cached for this engine shape: profiling it (quick, "
                "about a minute on 2 cores; once per machine and shape: cached at %s)", path)
    started = time.monotonic()
    model = await measure()
    log.warning("profiled in %.1f s", time.monotonic() - started)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        model.save(tmp)
        tmp.replace(path)
    except OSError as e:
        log.warning("could not cache the profile at %s: %s", path, e)
    return model


async def worker_cost_model(worker: ProfiledWorker, info: EngineInfo) -> CostModel:
    """A worker's cost model: the cached profile of its shape, else its quick profile (cached)."""

    async def measure() -> CostModel:
        return fit_profile(await worker.api.profile(True))

    return await cached_cost_model(profile_key(info, worker.spec.engine_config()), measure)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
