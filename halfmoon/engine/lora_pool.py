"""The worker's LoRA slots: a bounded pool of adapters resident for the model, paged in on demand.

    disk (the adapter folder) --read + check--> host cache (LRU, max_cpu_loras) --copy--> slot (LRU, max_loras)

Each fused projection has a shrink stack [layers, slots, in, k*R] and each module an expand stack
[layers, slots, R, out] (engine/lora.py's layout), allocated at the first adapter. A step names the adapters its rows
use (the scheduler lets at most `max_loras` distinct ones into a step); `activate` gives each a
slot, paging in what is not resident and evicting the least recently used adapter that this
step does not use. An evicted adapter's running requests lose nothing: their next step pages
it back in (from the host cache, or the folder again).

A step's LoRA (`LoraStep`): the rows of each slot gathered into [slots, m, in] (m = the most
rows any slot has this step; a slot's other rows are padding, zeroed after the shrink), then
per fused projection

    s = (x[rows] @ A[slot]) * keep                              one bmm for every adapter at once
    d = s[..., module's R] @ B_module[slot]                     one bmm per module, [slots, m, out]
    y[:, module's columns] += d[place]                         one gather: each row's own delta

`place` is each row's position in the padded layout (a row without an adapter reads a padding
position, whose delta is zero): a gather and an add, ~3x faster than scattering with index_add_.

Slots are taken lowest first and a step multiplies slots [0, n) (a view, no copy): a slot no row
of the step uses is all padding.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from halfmoon.core.adapters import TARGET_MODULES, AdapterRef, InvalidAdapterError, LoraShapes
from halfmoon.core.messages import LoraCounters
from halfmoon.engine.lora import StackedLora, check_adapter, module_columns, projection_dims, read_files, stack

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoraPoolStats:
    """Counters since start (the worker's metrics)."""

    disk_loads: int = 0  # adapters read from their folder (host cache misses)
    page_ins: int = 0  # copies host cache -> slot
    evictions: int = 0  # slots given to another adapter
    hits: int = 0  # adapters a step found resident
    load_s: float = 0.0  # time reading + checking folders
    requests: dict[str, int] = field(default_factory=dict)  # per adapter name: requests started


class LoraStep:
    """One step's LoRA: which rows use which slot (module docstring)."""

    __slots__ = ("rows", "place", "keep", "n", "m", "pool")

    def __init__(self, pool: LoraPool, rows: torch.Tensor | None, place: torch.Tensor | None,
                 keep: torch.Tensor | None, n: int, m: int) -> None:
        """`rows` / `place` / `keep` None: dense, the step's first n*m rows are slot 0's m rows,
        then slot 1's, ... (an all-decode step grouped by slot, equal groups): no gather."""
        self.pool, self.rows, self.place, self.keep, self.n, self.m = pool, rows, place, keep, n, m

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> torch.Tensor:
        """y (= the base projection of x) plus each row's adapter delta, in place."""
        pool, n, nm = self.pool, self.n, self.n * self.m
        if self.rows is None:
            shrunk = torch.bmm(x[:nm].view(n, self.m, x.shape[1]), pool.a[proj][layer, :n])
        else:
            xs = x.index_select(0, self.rows).view(n, self.m, x.shape[1])
            shrunk = torch.bmm(xs, pool.a[proj][layer, :n]).mul_(self.keep)
        r = pool.max_rank
        for k, (module, start, end) in enumerate(pool.columns[proj]):
            delta = torch.bmm(shrunk[:, :, k * r : (k + 1) * r], pool.b[module][layer, :n]).view(nm, end - start)
            if self.place is None:
                y[:nm, start:end].add_(delta)
            else:
                y[:, start:end].add_(delta.index_select(0, self.place))
        return y


class LoraPool:
    """The slots and host cache of one engine (module docstring). Thread-safe for `preload`
    (the worker's loader thread) against the engine thread's `activate`."""

    def __init__(self, shapes: LoraShapes, max_loras: int, max_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", check_base: bool = True) -> None:
        if max_loras < 1 or max_rank < 1 or max_cpu_loras < max_loras:
            raise ValueError(f"max_loras {max_loras} >= 1, max_lora_rank {max_rank} >= 1 and "
                             f"max_cpu_loras {max_cpu_loras} >= max_loras needed")
        self.shapes = shapes if check_base else LoraShapes(shapes.num_layers, shapes.modules)
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.dtype, self.device = dtype, torch.device(device)
        self.columns = module_columns(self.shapes)
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.slots: list[str | None] = [None] * max_loras  # digest resident in each slot
        self._used: OrderedDict[str, int] = OrderedDict()  # digest -> slot, least recently used first
        self._host: OrderedDict[str, StackedLora] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = LoraPoolStats()

    # ------------------------------------------------------------------ host cache

    def preload(self, ref: AdapterRef) -> StackedLora:
        """`ref` in the host cache (read from its folder and checked if it is not)."""
        with self._lock:
            cached = self._host.get(ref.digest)
            if cached is not None:
                self._host.move_to_end(ref.digest)
                return cached
        start = time.perf_counter()
        files = read_files(ref.path, ref.name)
        if files.digest != ref.digest:
            raise InvalidAdapterError(ref.name, f"the files in {ref.path} changed since it was loaded "
                                                f"(digest {files.digest}, loaded as {ref.digest}): load it again")
        stacked = stack(check_adapter(files, ref.name, self.shapes, self.max_rank), self.shapes,
                        self.max_rank, self.dtype)
        with self._lock:
            self.stats.disk_loads += 1
            self.stats.load_s += time.perf_counter() - start
            self._host[ref.digest] = stacked
            self._host.move_to_end(ref.digest)
            self._trim_host()
        return stacked

    def _trim_host(self) -> None:
        """Drop the least recently used host copies past `max_cpu_loras` (a resident adapter
        needs none: its slot holds it)."""
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    # ------------------------------------------------------------------ slots

    def activate(self, refs: Sequence[AdapterRef]) -> list[int]:
        """A slot for each of `refs` (distinct, at most `max_loras`), paging in what is missing."""
        if len(refs) > self.max_loras:
            raise RuntimeError(f"a step uses {len(refs)} adapters; the pool has {self.max_loras} slots")
        slots = []
        wanted = {r.digest for r in refs}
        for ref in refs:
            slot = self._used.get(ref.digest)
            if slot is None:
                slot = self._page_in(ref, wanted)
            else:
                self.stats.hits += 1
            self._used.move_to_end(ref.digest)
            slots.append(slot)
        return slots

    def _page_in(self, ref: AdapterRef, keep: set[str]) -> int:
        stacked = self.preload(ref)
        if not self.a:
            self._allocate()
        slot = self._free_slot(keep)
        for proj in self.a:
            self.a[proj][:, slot].copy_(stacked.a[proj])
        for module in self.b:
            self.b[module][:, slot].copy_(stacked.b[module])
        self.slots[slot] = ref.digest
        self._used[ref.digest] = slot
        self.stats.page_ins += 1
        return slot

    def _free_slot(self, keep: set[str]) -> int:
        """The lowest empty slot, else the least recently used one no adapter in `keep` holds."""
        if None in self.slots:
            return self.slots.index(None)
        victim = next(d for d in self._used if d not in keep)
        slot = self._used.pop(victim)
        self.stats.evictions += 1
        return slot

    def _allocate(self) -> None:
        n, s, r = self.shapes.num_layers, self.max_loras, self.max_rank
        for proj, (fan_in, k) in projection_dims(self.shapes).items():
            self.a[proj] = torch.zeros(n, s, fan_in, k * r, dtype=self.dtype, device=self.device)
        for module in TARGET_MODULES:
            fan_out = self.shapes.features(module)[1]
            self.b[module] = torch.zeros(n, s, r, fan_out, dtype=self.dtype, device=self.device)
        log.info("LoRA slots allocated: %d slots of rank %d, %.1f MiB", s, r, self.nbytes() / 2**20)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))

    def resident(self) -> list[str]:
        """Digests in the slots, most recently used last."""
        return list(self._used)

    def cached(self) -> list[str]:
        """Digests in the host cache not resident in a slot."""
        with self._lock:
            return [d for d in self._host if d not in self._used]

    def counters(self) -> LoraCounters:
        s = self.stats
        return LoraCounters(s.disk_loads, s.page_ins, s.evictions, s.hits, s.load_s,
                            tuple(sorted(s.requests.items())))

    def count_request(self, ref: AdapterRef) -> None:
        """A request under `ref` started here (the per-adapter traffic the metrics show)."""
        with self._lock:
            self.stats.requests[ref.name] = self.stats.requests.get(ref.name, 0) + 1

    # ------------------------------------------------------------------ steps

    def activate_step(self, adapters: Sequence[AdapterRef | None]) -> dict[AdapterRef, int]:
        """Slots for a step's adapters (`activate` of the distinct ones)."""
        refs = list(dict.fromkeys(ref for ref in adapters if ref is not None))
        return dict(zip(refs, self.activate(refs)))

    def step(self, order: Sequence[tuple[AdapterRef | None, int]],
             slot_of: dict[AdapterRef, int] | None = None) -> LoraStep | None:
        """The step's LoRA for its flat rows: `order` is (adapter or None, rows) per request in
        the step's flat order; `slot_of`: their slots (`activate_step`, done here when None).
        None when no row uses an adapter."""
        if slot_of is None:
            slot_of = self.activate_step([ref for ref, _ in order])
        if not slot_of:
            return None
        spans: list[list[tuple[int, int]]] = [[] for _ in range(max(slot_of.values()) + 1)]  # (first row, rows)
        row = 0
        for ref, count in order:
            if ref is not None:
                mine = spans[slot_of[ref]]
                if mine and sum(mine[-1]) == row:  # adjacent rows of one slot: one span
                    mine[-1] = (mine[-1][0], mine[-1][1] + count)
                else:
                    mine.append((row, count))
            row += count
        counts = [sum(c for _, c in s) for s in spans]
        n, m = len(spans), max(counts)
        if all(s == [(slot * m, m)] for slot, s in enumerate(spans)):  # grouped, equal: dense
            return LoraStep(self, None, None, None, n, m)
        if sum(counts) < row and n * m == sum(counts):
            m += 1  # rows without an adapter read a padding position: have one
        rows = torch.zeros(n, m, dtype=torch.long)  # padding reads row 0; `keep` zeroes its delta
        keep = torch.zeros(n, m, 1, dtype=self.dtype)
        zero = next(slot * m + counts[slot] for slot in range(n) if counts[slot] < m) if sum(counts) < row else 0
        place = torch.full((row,), zero, dtype=torch.long)
        for slot, slot_spans in enumerate(spans):
            if slot_spans:
                taken = torch.cat([torch.arange(first, first + c) for first, c in slot_spans])
                rows[slot, : counts[slot]] = taken
                keep[slot, : counts[slot]] = 1
                place[taken] = torch.arange(slot * m, slot * m + counts[slot])
        return LoraStep(self, rows.view(-1).to(self.device), place.to(self.device), keep.to(self.device), n, m)

    def check(self) -> None:
        """Invariants: each resident digest in exactly one slot and no slot twice, sizes bounded."""
        assert len(self._used) <= self.max_loras, (len(self._used), self.max_loras)
        for digest, slot in self._used.items():
            assert self.slots[slot] == digest, (slot, digest, self.slots[slot])
        assert sum(d is not None for d in self.slots) == len(self._used), (self.slots, self._used)
        assert len(set(self._used.values())) == len(self._used), self._used
        with self._lock:
            assert len(self._host) <= self.max_cpu_loras, (len(self._host), self.max_cpu_loras)
