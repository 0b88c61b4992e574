"""What both ends of a KV transfer must agree on, and the byte views of a layer's blocks.

The device KV tensor is `[layers, 2, num_blocks, block_size, kv_heads, head_dim]` (docs/ARCHITECTURE.md, "KV layout").
For one layer, each of K and V holds a block as one contiguous slab of
`block_size * kv_heads * head_dim * itemsize` bytes. A transfer unit (request, layer, block ids)
travels as the byte stream

    | K slab of ids[0] | K slab of ids[1] | ... | V slab of ids[0] | ... | V slab of ids[n-1] |

Sender and receiver cut that stream into views of their *own* tensors (their block ids differ);
runs of consecutive ids become one view, so a fresh, unfragmented pool moves as a few large views.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from transport.errors import ProtocolError


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The handshake compares every field; a mismatch names the first one that differs."""

    fingerprint: str  # the model fingerprint (engine.model_config): same weights, same KV
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # canonical torch dtype name, e.g. "float32", "bfloat16"
    # per layer: its sliding window in tokens, 0 = full attention (() = every layer full). A
    # sliding layer's blocks before the window are not sent (core.blocks.first_visible_block).
    windows: tuple[int, ...] = ()
    # tensor parallel (engine/parallel.py): the sender's / receiver's tensor-parallel size and the
    # first of this rank's `num_kv_heads` KV heads. Moving KV between different layouts (each
    # rank receiving its heads' slices) is issue 35's point 2, not built: the handshake refuses
    # any difference, so no rank ever reads another layout's bytes as its own.
    tp: int = 1
    kv_head_start: int = 0

    @classmethod
    def of(cls, kv_cache: torch.Tensor, fingerprint: str, windows: Sequence[int] = (), tp: int = 1,
           kv_head_start: int = 0) -> KVLayout:
        layers, two, _, block_size, heads, head_dim = kv_cache.shape
        if two != 2:
            raise ValueError(f"expected a [layers, 2, blocks, block_size, heads, head_dim] KV tensor, got {tuple(kv_cache.shape)}")
        if windows and len(windows) != layers:
            raise ValueError(f"{len(windows)} layer windows for a KV tensor of {layers} layers")
        windows = tuple(int(w) for w in windows) if any(windows) else ()
        return cls(fingerprint, layers, block_size, heads, head_dim, str(kv_cache.dtype).removeprefix("torch."), windows,
                   tp, kv_head_start)

    @property
    def itemsize(self) -> int:
        return getattr(torch, self.dtype).itemsize

    @property
    def slab_bytes(self) -> int:
        """Bytes of one block of K (or V) in one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    def unit_bytes(self, num_blocks: int) -> int:
        """Payload bytes of a transfer unit of `num_blocks` blocks (K and V)."""
        return 2 * num_blocks * self.slab_bytes

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["windows"] = list(self.windows)  # as it reads back from the handshake's JSON
        return d


class KVShape:
    """What a KV tensor's block ids are checked against, and where a unit's views break: its
    layers, blocks and slab size, on any device."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        layers, _, num_blocks = kv_cache.shape[:3]
        self.num_layers = layers
        self.num_blocks = num_blocks
        self.slab_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()

    def bounds(self, block_ids: Sequence[int]) -> list[int]:
        """Byte offsets (in a unit's payload) at which `views(layer, block_ids)` breaks: the end
        of each view but the last. The same for every layer; computed from the ids alone, so a
        sender knows its receiver's breaks too."""
        starts, stops = _runs(np.asarray(block_ids, dtype=np.int64))
        run_bytes = (stops - starts) * self.slab_bytes
        return np.cumsum(np.concatenate([run_bytes, run_bytes]))[:-1].tolist()

    def check(self, layer: int, block_ids: Sequence[int]) -> np.ndarray:
        """The ids as an int64 array; ProtocolError unless `layer` and every id are in range."""
        if not 0 <= layer < self.num_layers:
            raise ProtocolError(f"layer {layer} is not in 0..{self.num_layers - 1}")
        ids = np.asarray(block_ids)
        if ids.size and ids.dtype.kind not in "iu":
            raise ProtocolError(f"block ids must be integers, got {ids.dtype} values")
        bad = (ids < 0) | (ids >= self.num_blocks)
        if bad.any():
            raise ProtocolError(f"block id {ids[bad.argmax()]} is not in 0..{self.num_blocks - 1}")
        return ids.astype(np.int64)


class KVBytes(KVShape):
    """A byte-level view of a host KV tensor: `[layers, 2, num_blocks, slab_bytes]` uint8, no copy."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        if not kv_cache.is_contiguous() or kv_cache.device.type != "cpu":
            raise ValueError("the KV tensor must be a contiguous CPU tensor")
        super().__init__(kv_cache)
        self.tensor = kv_cache  # keeps the storage alive as long as the views
        self.array: np.ndarray = kv_cache.view(torch.uint8).numpy().reshape(self.num_layers, 2, self.num_blocks, -1)

    def views(self, layer: int, block_ids: Sequence[int]) -> list[memoryview]:
        """K then V slabs of `block_ids` in layer `layer`, one view per run of consecutive ids."""
        ids = self.check(layer, block_ids)
        starts, stops = _runs(ids)
        arr = self.array
        runs = list(zip(starts, stops))
        return [memoryview(arr[layer, kv, start:stop]).cast("B") for kv in (0, 1) for start, stop in runs]


def _runs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[start, stop) runs of consecutive ids, in order, as (starts, stops):
    [3, 4, 5, 9] -> ([3, 9], [6, 10]). Vectorized: a unit of thousands of blocks costs no
    Python object per block."""
    if ids.size == 0:
        return ids, ids
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = ids[np.concatenate(([0], breaks))]
    stops = ids[np.concatenate((breaks - 1, [ids.size - 1]))] + 1
    return starts, stops
