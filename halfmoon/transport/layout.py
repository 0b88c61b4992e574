"""What both ends of a KV transfer must agree on, and the byte views of a layer's blocks.

The device KV tensor is `[layers, 2, num_blocks, block_size, kv_heads, head_dim]` (docs/ARCHITECTURE.md, "KV layout").
For one layer, each of K and V holds a block as one contiguous slab of
`block_size * kv_heads * head_dim * itemsize` bytes. A transfer unit (request, layer, block ids)
travels as the byte stream

    | K slab of ids[0] | K slab of ids[1] | ... | V slab of ids[0] | ... | V slab of ids[n-1] |

Sender and receiver cut that stream into views of their *own* tensors (their block ids differ);
runs of consecutive ids become one view, so a fresh, unfragmented pool moves as a few large views.

Between tensor-parallel layouts (transport/heads.py) a connection carries one `HeadPiece`: the
slab of a block is then `[block_size, piece heads, head_dim]`. A side whose whole shard is the
piece still moves its slabs in place; a side that holds more heads than the piece (a prefill rank
sending part of its heads, a decode rank receiving part of its heads from each of several
prefill ranks) moves them through a staging copy: the sender gathers the heads' strided slices
of a unit's blocks into one buffer, the receiver lands the payload in one, verifies its checksum
and only then scatters it into its blocks (`KVBytes` with `heads`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch

from halfmoon.transport.errors import ProtocolError


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
    # tensor parallel (engine/parallel.py, transport/heads.py): this side's tensor-parallel size,
    # its rank, the first of its `num_kv_heads` KV heads and the model's KV heads in all. The
    # handshake lets two layouts that differ only here connect when the plan gives the pair a
    # piece of heads to move (`compatible`); every other field must be equal.
    tp: int = 1
    kv_head_start: int = 0
    rank: int = 0
    model_kv_heads: int = 0  # the model's KV heads; `of` sets it (num_kv_heads when tp is 1)

    @classmethod
    def of(cls, kv_cache: torch.Tensor, fingerprint: str, windows: Sequence[int] = (), tp: int = 1,
           kv_head_start: int = 0, rank: int = 0, model_kv_heads: int | None = None) -> KVLayout:
        layers, two, _, block_size, heads, head_dim = kv_cache.shape
        if two != 2:
            raise ValueError(f"expected a [layers, 2, blocks, block_size, heads, head_dim] KV tensor, got {tuple(kv_cache.shape)}")
        if windows and len(windows) != layers:
            raise ValueError(f"{len(windows)} layer windows for a KV tensor of {layers} layers")
        windows = tuple(int(w) for w in windows) if any(windows) else ()
        total = heads if model_kv_heads is None else model_kv_heads
        return cls(fingerprint, layers, block_size, heads, head_dim, str(kv_cache.dtype).removeprefix("torch."), windows,
                   tp, kv_head_start, rank, total)

    @classmethod
    def from_dict(cls, d: object) -> KVLayout:
        """A layout as `as_dict` wrote it (the handshake's JSON); ProtocolError when malformed."""
        if not isinstance(d, dict):
            raise ProtocolError("the handshake carries no KV layout")
        try:
            values = {f.name: d[f.name] for f in fields(cls)}
            values["windows"] = tuple(values["windows"])
            return cls(**values)
        except (KeyError, TypeError) as e:
            raise ProtocolError(f"malformed KV layout in the handshake: {e}") from e

    @property
    def total_kv_heads(self) -> int:
        """The model's KV heads (a layout built by hand without them: this rank's)."""
        return self.model_kv_heads or self.num_kv_heads

    def model_fields(self) -> dict[str, object]:
        """What two sides must agree on whatever their tensor-parallel layouts."""
        d = self.as_dict()
        for name in ("num_kv_heads", "tp", "kv_head_start", "rank", "model_kv_heads"):
            d.pop(name)
        d["total_kv_heads"] = self.total_kv_heads
        return d

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
    layers, blocks and slab size, on any device. `heads`: the KV heads (of this tensor's) a
    connection moves; None or all of them: whole slabs; fewer: a head slice (staged through a
    copy, the module docstring)."""

    def __init__(self, kv_cache: torch.Tensor, heads: slice | None = None) -> None:
        layers, _, num_blocks = kv_cache.shape[:3]
        self.num_layers = layers
        self.num_blocks = num_blocks
        num_heads = kv_cache.shape[4] if kv_cache.dim() == 6 else None
        whole = heads is None or (heads.start, heads.stop) == (0, num_heads)
        self.heads: slice | None = None if whole else heads
        slab_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
        if self.heads is not None:
            assert num_heads is not None
            slab_bytes = slab_bytes // num_heads * (self.heads.stop - self.heads.start)
        self.slab_bytes = slab_bytes

    @property
    def staged(self) -> bool:
        """A head slice of this tensor's slabs: moved through a staging copy."""
        return self.heads is not None

    def unit_bytes(self, num_blocks: int) -> int:
        """Payload bytes of a unit of `num_blocks` blocks (K and V) over this connection."""
        return 2 * num_blocks * self.slab_bytes

    def bounds(self, block_ids: Sequence[int]) -> list[int]:
        """Byte offsets (in a unit's payload) at which this side's views break: the end of each
        view but the last. The same for every layer; computed from the ids alone, so a sender
        knows its receiver's breaks too (`run_bounds`). A head-sliced side has one view."""
        return [] if self.staged else run_bounds(block_ids, self.slab_bytes)

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


def run_bounds(block_ids: Sequence[int], slab_bytes: int) -> list[int]:
    """Where views of whole slabs of `block_ids` break in a unit's payload (`KVBytes.bounds`)."""
    starts, stops = _runs(np.asarray(block_ids, dtype=np.int64))
    run_bytes = (stops - starts) * slab_bytes
    return np.cumsum(np.concatenate([run_bytes, run_bytes]))[:-1].tolist()


def _bytes_view(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's bytes (the view keeps the tensor alive)."""
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()).cast("B")


class KVBytes(KVShape):
    """A byte-level view of a host KV tensor: `[layers, 2, num_blocks, slab_bytes]` uint8, no
    copy; `heads` as in KVShape (a head slice reads with `read_views`, writes with `write_views`)."""

    def __init__(self, kv_cache: torch.Tensor, heads: slice | None = None) -> None:
        if not kv_cache.is_contiguous() or kv_cache.device.type != "cpu":
            raise ValueError("the KV tensor must be a contiguous CPU tensor")
        super().__init__(kv_cache, heads)
        self.tensor = kv_cache  # keeps the storage alive as long as the views
        self.array: np.ndarray = kv_cache.view(torch.uint8).numpy().reshape(self.num_layers, 2, self.num_blocks, -1)

    def views(self, layer: int, block_ids: Sequence[int]) -> list[memoryview]:
        """K then V slabs of `block_ids` in layer `layer`, one view per run of consecutive ids
        (whole slabs only: a head slice reads with `read_views`, writes with `write_views`)."""
        if self.staged:
            raise ValueError("a head slice of the KV tensor moves through read_views / write_views")
        ids = self.check(layer, block_ids)
        starts, stops = _runs(ids)
        arr = self.array
        runs = list(zip(starts, stops))
        return [memoryview(arr[layer, kv, start:stop]).cast("B") for kv in (0, 1) for start, stop in runs]

    def read_views(self, layer: int, block_ids: Sequence[int]) -> list[memoryview]:
        """What a sender sends: the slabs in place, or the heads' slices gathered into one
        buffer (K of every block, then V: the payload's order)."""
        if not self.staged:
            return self.views(layer, block_ids)
        ids = torch.from_numpy(self.check(layer, block_ids))
        gathered = self.tensor[layer][:, ids, :, self.heads].contiguous()
        return [_bytes_view(gathered)]

    def write_views(self, layer: int, block_ids: Sequence[int]
                    ) -> tuple[list[memoryview], Callable[[], None] | None]:
        """Where a receiver lands a unit, and what puts it in place once its checksum verified
        (None: it landed in place)."""
        if not self.staged:
            return self.views(layer, block_ids), None
        ids = torch.from_numpy(self.check(layer, block_ids))
        _, _, _, block_size, _, head_dim = self.tensor.shape
        assert self.heads is not None
        staging = torch.empty(2, len(ids), block_size, self.heads.stop - self.heads.start, head_dim,
                              dtype=self.tensor.dtype)

        def commit() -> None:
            self.tensor[layer][:, ids, :, self.heads] = staging

        return [_bytes_view(staging)], commit


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
