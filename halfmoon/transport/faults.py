"""Fault injection for tests and drills: flip one bit of chosen transfer units on the wire.

    faults = FaultInjector()
    faults.corrupt_next(request_id="r1", layer=3)   # the next matching unit goes out corrupted
    sender = KVSender(..., faults=faults)

The sender computes the checksum over the true bytes and sends a copy with one bit flipped, as a
broken NIC or DMA would; the receiver must detect it and never use the data.

A receiver given an injector with `receive_delay` sleeps that long before reading each message:
a slow receiver, against which the sender's memory must stay bounded.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(slots=True)
class _Rule:
    request_id: str | None
    layer: int | None
    remaining: int


class FaultInjector:
    def __init__(self) -> None:
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self.injected = 0
        self.receive_delay = 0.0  # seconds a receiver waits before reading each message

    def corrupt_next(self, request_id: str | None = None, layer: int | None = None, times: int = 1) -> None:
        """Corrupt the next `times` units matching (None matches anything). A request id also
        matches its tries on the workers, `{id}@{n}` (conductor/request_names.py)."""
        if times < 1:
            raise ValueError(f"times must be >= 1, got {times}")
        with self._lock:
            self._rules.append(_Rule(request_id, layer, times))

    def should_corrupt(self, request_id: str, layer: int) -> bool:
        if not self._rules:  # the usual case (a worker's drill hook, idle): no lock per unit
            return False
        with self._lock:
            for rule in self._rules:
                if _names(rule.request_id, request_id) and rule.layer in (None, layer):
                    rule.remaining -= 1
                    if not rule.remaining:
                        self._rules.remove(rule)
                    self.injected += 1
                    return True
        return False


def _names(wanted: str | None, request_id: str) -> bool:
    return wanted is None or request_id == wanted or request_id.startswith(wanted + "@")


def flip_one_bit(view: memoryview) -> memoryview:
    """A corrupted copy of `view`: bit 0 of its middle byte flipped."""
    data = bytearray(view)
    data[len(data) // 2] ^= 1
    return memoryview(data)
