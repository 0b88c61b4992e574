"""KV transfer from (and into) device memory through a ring of pinned host staging slots.

A KV tensor in host memory is sent straight from its own pages (transport/layout.py KVBytes: the
`host` path). A KV tensor on a GPU is not host-addressable, so each transfer unit goes through
one slot of a staging ring (the `staged` path):

    prefill (engine thread, layer hook)      sender thread                 receiver thread
    stage(layer, ids):                       wait(slot.event)              slot = acquire()
      slot = acquire()  (waits: backpressure) send slot's bytes             receive into slot
      copy-stream waits layer l's compute    release(slot) after the        land(slot): copy into
      gather K|V slabs -> slot (async D2H)     send completed                 the device blocks
      record slot.event                                                     release(slot)

The engine thread never synchronizes: a layer's copy waits for that layer's compute on the copy
stream (an event recorded on the compute stream), so layer l's copy and send overlap the compute
of layers l+1.. (layer pipelining with per-layer CUDA events, not syncs). Invariants, checked
by `StagingRing.check_integrity` and the CPU tests:

- a slot is reused only after `release`, i.e. after the send that reads it completed;
- slots are handed out in FIFO order and the sender sends units in the order they were staged,
  so a request's layers leave in layer order;
- a slot's bytes are the unit's payload: | K slabs of ids | V slabs of ids | (layout.py).

Copiers: `CudaCopier` (a side stream, torch.cuda.Event per slot, pinned slots) and `HostCopier`,
the same protocol over host memory with one copy thread as the "stream" and a threading.Event
per slot: the CPU tests drive the ring, the events and the sender through it.

The handshake's HELLO names the path (`path`: host, staged); the receiver counts bytes per path
(ReceiverStats.bytes_by_path, the `path` label of halfmoon_kv_transfer_bytes_total). A direct
UCX send of device memory (ucxx with cuda_copy / cuda_ipc: `ucx-cuda`) is not built: a CUDA KV
tensor always takes the staged path.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from halfmoon.transport.errors import ProtocolError, TransferTimeoutError

HOST, STAGED, UCX_CUDA = "host", "staged", "ucx-cuda"
PATHS = (HOST, STAGED, UCX_CUDA)
DEFAULT_SLOTS = 8  # units staged or on the wire at once (a sender posts up to 8 jobs)


def send_path(kv_cache: torch.Tensor) -> str:
    """How a KV tensor's units leave: from its own pages (host) or through staging slots."""
    return HOST if kv_cache.device.type == "cpu" else STAGED


class CopyEvent(Protocol):
    """Completion of one slot's copy."""

    def wait(self, timeout: float) -> bool: ...


class Slot:
    """One staging buffer: `host` (uint8, pinned on CUDA) and, while staged, the unit it holds."""

    __slots__ = ("index", "host", "event", "layer", "nbytes")

    def __init__(self, index: int, host: torch.Tensor) -> None:
        self.index = index
        self.host = host
        self.event: CopyEvent | None = None
        self.layer = -1
        self.nbytes = 0

    def view(self) -> memoryview:
        """The staged unit's bytes (host memory, valid until the slot is released)."""
        return memoryview(self.host[: self.nbytes].numpy()).cast("B")


class StagingRing:
    """`num_slots` slots of `slot_bytes`, handed out FIFO, each back only on `release`."""

    def __init__(self, num_slots: int, slot_bytes: int, pin: bool = False) -> None:
        if num_slots < 1 or slot_bytes < 1:
            raise ValueError(f"a staging ring needs slots of bytes, got {num_slots} x {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.slots = [Slot(i, torch.empty(slot_bytes, dtype=torch.uint8, device="cpu", pin_memory=pin))
                      for i in range(num_slots)]
        self._free: deque[Slot] = deque(self.slots)
        self._cond = threading.Condition()
        self.acquired = 0  # slots handed out since start (the order tests read it)

    def acquire(self, timeout: float) -> Slot:
        """The oldest free slot; waits up to `timeout` while every slot is staged or sending."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout):
                raise TransferTimeoutError(f"staging: all {len(self.slots)} slots still in flight after {timeout:.1f}s")
            self.acquired += 1
            return self._free.popleft()

    def release(self, slot: Slot) -> None:
        with self._cond:
            if any(s is slot for s in self._free):
                raise ValueError(f"staging slot {slot.index} released twice")
            slot.event, slot.layer, slot.nbytes = None, -1, 0
            self._free.append(slot)
            self._cond.notify_all()

    @property
    def in_use(self) -> int:
        with self._cond:
            return len(self.slots) - len(self._free)

    def check_integrity(self) -> None:
        """free + in use == total, no slot free twice, a free slot holds no unit."""
        with self._cond:
            ids = [s.index for s in self._free]
            if len(ids) != len(set(ids)) or not set(ids) <= set(range(len(self.slots))):
                raise AssertionError(f"staging ring: free list {ids} is not a set of slots")
            if any(s.event is not None or s.nbytes for s in self._free):
                raise AssertionError("staging ring: a free slot still holds a unit")


def slab_index(kv_cache: torch.Tensor, layer: int, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) of `layer` as [num_blocks, slab elements] and the ids as an index on their device."""
    layer_kv = kv_cache[layer].flatten(2)  # [2, num_blocks, slab]
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=kv_cache.device)
    return layer_kv, idx


class HostCopier:
    """The staging protocol over host memory: copies run in order on one thread (the "copy
    stream"); each slot's threading.Event is set when its copy is done."""

    def __init__(self) -> None:
        self._work: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-staging-copy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._work.get()) is not None:
            job()

    def gather(self, kv_cache: torch.Tensor, layer: int, block_ids: Sequence[int], slot: Slot) -> CopyEvent:
        done = _HostEvent()
        ids = list(block_ids)

        def copy() -> None:
            layer_kv, idx = slab_index(kv_cache, layer, ids)
            n = len(ids)
            out = slot.host[: slot.nbytes].view(kv_cache.dtype).view(2, n, -1)
            torch.index_select(layer_kv[0], 0, idx, out=out[0])
            torch.index_select(layer_kv[1], 0, idx, out=out[1])
            done.set()

        self._work.put(copy)
        return done

    def scatter(self, slot: Slot, kv_cache: torch.Tensor, layer: int, block_ids: Sequence[int]) -> None:
        """The slot's unit into `block_ids` of `layer` (synchronous: the slot is free after)."""
        _scatter(slot, kv_cache, layer, block_ids)

    def close(self) -> None:
        self._work.put(None)
        self._thread.join(timeout=5)


class _HostEvent:
    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)


class _CudaEvent:
    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self, timeout: float) -> bool:
        self.event.synchronize()  # this thread only (the sender's); the copy is bounded
        return True


class CudaCopier:
    """Device -> pinned slot copies on a side stream: each waits for the compute stream's work
    queued so far (the layer just computed), then gathers the slabs on the device and copies
    them to the slot, and records the slot's event. The engine thread never blocks."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def gather(self, kv_cache: torch.Tensor, layer: int, block_ids: Sequence[int], slot: Slot) -> CopyEvent:
        computed = torch.cuda.Event()
        computed.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(computed)
            layer_kv, idx = slab_index(kv_cache, layer, block_ids)
            staged = torch.stack((layer_kv[0].index_select(0, idx), layer_kv[1].index_select(0, idx)))
            slot.host[: slot.nbytes].copy_(staged.view(-1).view(torch.uint8), non_blocking=True)
            staged.record_stream(self.stream)  # freed only after this stream is past the copy
            done = torch.cuda.Event()
            done.record(self.stream)
        return _CudaEvent(done)

    def scatter(self, slot: Slot, kv_cache: torch.Tensor, layer: int, block_ids: Sequence[int]) -> None:
        """The slot's unit into the device blocks, on the side stream, waited for: the slot is
        reused once this returns, and the decode step that reads the blocks comes after."""
        with torch.cuda.stream(self.stream):
            _scatter(slot, kv_cache, layer, block_ids)
        self.stream.synchronize()

    def close(self) -> None:
        self.stream.synchronize()


def _scatter(slot: Slot, kv_cache: torch.Tensor, layer: int, block_ids: Sequence[int]) -> None:
    n = len(block_ids)
    layer_kv, idx = slab_index(kv_cache, layer, block_ids)
    rows = slot.host[: slot.nbytes].view(kv_cache.dtype).view(2, n, -1).to(kv_cache.device, non_blocking=True)
    layer_kv[0].index_copy_(0, idx, rows[0])
    layer_kv[1].index_copy_(0, idx, rows[1])


Copier = HostCopier | CudaCopier


class Stager:
    """A KV tensor's staging: the ring, its copier, and the unit size a slot holds."""

    def __init__(self, kv_cache: torch.Tensor, ring: StagingRing, copier: Copier) -> None:
        self.kv_cache = kv_cache
        self.ring = ring
        self.copier = copier
        self.slab_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
        self.slot_blocks = ring.slot_bytes // (2 * self.slab_bytes)
        if self.slot_blocks < 1:
            raise ValueError(f"a staging slot of {ring.slot_bytes} bytes holds no block ({2 * self.slab_bytes} bytes)")

    @classmethod
    def for_device(cls, kv_cache: torch.Tensor, inflight_bytes: int, num_slots: int = DEFAULT_SLOTS) -> Stager:
        """Pinned slots splitting `inflight_bytes` (at least one block each) and a CUDA copier."""
        slab = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
        slot_bytes = max(2 * slab, inflight_bytes // num_slots // (2 * slab) * 2 * slab)
        return cls(kv_cache, StagingRing(num_slots, slot_bytes, pin=True), CudaCopier(kv_cache.device))

    def chunks(self, ids: Sequence[int]) -> list[Sequence[int]]:
        """`ids` cut into units a slot holds, in order."""
        step = self.slot_blocks
        return [ids[i : i + step] for i in range(0, len(ids), step)]

    def stage(self, layer: int, block_ids: Sequence[int], timeout: float) -> Slot:
        """Queue the copy of `layer`'s blocks into a slot (waits only for a free slot)."""
        if len(block_ids) > self.slot_blocks:
            raise ValueError(f"{len(block_ids)} blocks do not fit a {self.slot_blocks}-block staging slot")
        slot = self.ring.acquire(timeout)
        slot.layer, slot.nbytes = layer, 2 * len(block_ids) * self.slab_bytes
        slot.event = self.copier.gather(self.kv_cache, layer, block_ids, slot)
        return slot

    def landing(self, nbytes: int, timeout: float) -> Slot:
        """A slot a received unit of `nbytes` lands in before `land`."""
        if nbytes > self.ring.slot_bytes:
            raise ProtocolError(f"a unit of {nbytes} bytes does not fit this receiver's {self.ring.slot_bytes}-byte "
                                "staging slots: give senders and receivers the same --kv-max-inflight-mb")
        slot = self.ring.acquire(timeout)
        slot.nbytes = nbytes
        return slot

    def land(self, slot: Slot, layer: int, block_ids: Sequence[int]) -> None:
        """A verified unit from its slot into the device blocks."""
        self.copier.scatter(slot, self.kv_cache, layer, block_ids)

    def close(self) -> None:
        self.copier.close()
