"""The Conductor's LoRA adapters: which names it serves, each checked once against the base model.

    --lora NAME=PATH (start), admin load/unload (run time)  ->  AdapterRegistry
    request `model` = NAME  ->  resolve()  ->  AdapterRef (name, path, digest) in its SamplingParams

The registry reads and checks an adapter when it is loaded (engine/lora.py: config, target
modules, shapes, rank, base model; one `InvalidAdapterError` each), so a bad adapter is refused at
the door, never at a worker. Workers read the same folder when a request first needs it
(engine/lora_pool.py): the path must be readable on every node (a shared volume). Unloading
removes the name at once: new requests for it get 404, running ones finish (they carry their
`AdapterRef`; the workers' slots keep the weights until evicted).
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from dataclasses import dataclass

from halfmoon.conductor.errors import ConflictError, ModelNotFoundError, ResourceNotFoundError
from halfmoon.core.adapters import AdapterRef, InvalidAdapterError, LoraShapes
from halfmoon.engine.lora import check_adapter, read_files

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


@dataclass(frozen=True, slots=True)
class LoraStats:
    """The registry for /metrics and the dashboard: adapters served, requests per adapter name
    (since start, unloaded ones included), loads and unloads."""

    loaded: tuple[str, ...] = ()
    requests: tuple[tuple[str, int], ...] = ()
    loads: int = 0
    unloads: int = 0


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """A loaded adapter as the admin API and /v1/models describe it."""

    name: str
    path: str
    digest: str
    rank: int
    targets: tuple[str, ...]
    base_model: str
    loaded_at: float  # time.time()
    load_ms: float  # reading + checking it at the Conductor

    @property
    def ref(self) -> AdapterRef:
        return AdapterRef(self.name, self.path, self.digest)


class AdapterRegistry:
    """Served adapter names (module docstring). Thread-safe: loads read files on a thread."""

    def __init__(self, base_id: str, shapes: LoraShapes | None, max_rank: int,
                 why_off: str = "") -> None:
        """`shapes`: the base model's (None: adapters are not served, `why_off` says why)."""
        self.base_id, self.shapes, self.max_rank = base_id, shapes, max_rank
        self.why_off = why_off or "this server serves no LoRA adapters"
        self._adapters: dict[str, AdapterInfo] = {}
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # per adapter name: requests resolved to it
        self.loads = 0
        self.unloads = 0

    def load(self, name: str, path: str) -> AdapterInfo:
        """Read and check the adapter at `path`, serve it as `name`. Loading the same files under
        the same name again is a no-op; other files under a served name are a ConflictError
        (unload it first)."""
        self._check_name(name)
        if self.shapes is None:
            raise InvalidAdapterError(name, self.why_off)
        start = time.perf_counter()
        files = read_files(path, name)
        spec = check_adapter(files, name, self.shapes, self.max_rank)
        info = AdapterInfo(name, str(path), files.digest, spec.rank, spec.targets, spec.base_model,
                           time.time(), (time.perf_counter() - start) * 1e3)
        with self._lock:
            old = self._adapters.get(name)
            if old is not None:
                if old.digest == info.digest:
                    return old
                raise ConflictError(f"adapter {name!r} is loaded with other weights ({old.path}, digest "
                                    f"{old.digest}); unload it first")
            self._adapters[name] = info
            self.loads += 1
        return info

    def unload(self, name: str) -> AdapterInfo:
        """Stop serving `name` (ResourceNotFoundError when it is not loaded)."""
        with self._lock:
            info = self._adapters.pop(name, None)
            if info is None:
                raise ResourceNotFoundError(f"no adapter named {name!r} is loaded; loaded: {sorted(self._adapters)}")
            self.unloads += 1
        return info

    def resolve(self, model: str) -> AdapterRef | None:
        """The adapter a request's `model` names; None for the base model ("" or its id);
        ModelNotFoundError for anything else."""
        if not model or model == self.base_id:
            return None
        with self._lock:
            info = self._adapters.get(model)
        if info is None:
            raise ModelNotFoundError(model, [self.base_id, *self.names()])
        self.requests[model] += 1
        return info.ref

    def load_ms(self, name: str) -> float:
        """How long reading `name` took here (0 when it is not loaded): the router's estimate of a
        worker's first read of it."""
        with self._lock:
            info = self._adapters.get(name)
        return info.load_ms if info is not None else 0.0

    def snapshot(self) -> LoraStats:
        with self._lock:
            return LoraStats(tuple(sorted(self._adapters)), tuple(sorted(self.requests.items())),
                             self.loads, self.unloads)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._adapters)

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return [self._adapters[n] for n in sorted(self._adapters)]

    def _check_name(self, name: str) -> None:
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidAdapterError(str(name)[:64], "a name is 1-128 letters, digits and ._:/@+- , starting "
                                                      "with a letter or digit")
        if name == self.base_id:
            raise InvalidAdapterError(name, "is the base model's name")
