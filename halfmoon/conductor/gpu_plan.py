"""How `serve`'s workers get GPUs: one each where there are enough, else a share of one.

    visible GPUs >= workers:  each worker asks Ray for 1 GPU (its own; Ray sets its
                              CUDA_VISIBLE_DEVICES) and may use all of its memory
    fewer:                    k = ceil(workers / GPUs) workers per GPU; each asks 1/k of a GPU
                              and caps its allocator at (1 - SHARED_HEADROOM) / k of the memory
                              (torch.cuda.set_per_process_memory_fraction), the headroom being
                              for the k CUDA contexts, which the cap does not count

A CPU engine asks for no GPU. An explicit per-role GPU count (`--prefill-gpus`, a Helm
worker group's `gpus`) wins; an explicit `--gpu-memory-fraction` wins over the derived cap.
A Conductor joining a Ray cluster (`--ray-address`) cannot see the workers' GPUs: without an
explicit count each worker asks for 1.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from halfmoon.core.errors import ConfigError

SHARED_HEADROOM = 0.08  # of one GPU's memory, kept out of the workers' caps when they share it


class GpuShare(NamedTuple):
    """What one worker asks for: Ray `num_gpus` (0 = none) and its allocator cap (0 = none)."""

    gpus: float
    memory_fraction: float


def plan_gpus(device: str, visible: int | None, workers: int, memory_fraction: float = 0.0) -> GpuShare:
    """The share of each of `workers` CUDA workers over `visible` GPUs (None: unknown, a joined
    Ray cluster); `memory_fraction` > 0 is the operator's own cap."""
    if device != "cuda":
        return GpuShare(0.0, 0.0)
    if visible is None:
        return GpuShare(1.0, memory_fraction)
    if visible < 1:
        raise ConfigError("--device cuda: this machine sees no CUDA device (check the driver and "
                          "CUDA_VISIBLE_DEVICES), or use --device cpu")
    if visible >= workers:
        return GpuShare(1.0, memory_fraction)
    per_gpu = math.ceil(workers / visible)
    fraction = memory_fraction or round((1.0 - SHARED_HEADROOM) / per_gpu, 4)
    # Ray counts GPU shares in units of 1e-4: round down so k shares fit one GPU
    return GpuShare(math.floor(1e4 / per_gpu) / 1e4, fraction)


def visible_gpus() -> int:
    """CUDA devices this process sees (0 without torch or a driver)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0
