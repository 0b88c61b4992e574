"""What the host arena's and the disk tier's tests share: block hashes and contents, a wrapper
that checks integrity after every verb, and a reference LRU model driven by random operations."""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest

from halfmoon.kvpool.errors import HashStateError
from halfmoon.kvpool.tier_base import BlockTier, PutResult

SLOT_BYTES = 64


def key(i: int | str) -> bytes:
    """A 16-byte block hash, as the real ones: sha256 truncated."""
    return hashlib.sha256(f"block-{i}".encode()).digest()[:16]


def content(k: bytes, nbytes: int = SLOT_BYTES) -> np.ndarray:
    """The bytes every test stores under hash `k` (so any hit can be checked)."""
    return np.frombuffer(hashlib.shake_128(k).digest(nbytes), dtype=np.uint8).copy()


def blocks(keys: list[bytes], nbytes: int = SLOT_BYTES) -> np.ndarray:
    return np.stack([content(k, nbytes) for k in keys]) if keys else np.zeros((0, nbytes), np.uint8)



class Checked:
    """A tier whose every verb is followed by check_integrity(), even a verb that raised."""

    def __init__(self, tier: Any) -> None:
        self.tier = tier
        tier.check_integrity()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.tier, name)
        if not callable(attr) or name in ("close", "unlink"):
            return attr

        def checked(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            finally:
                self.tier.check_integrity()

        return checked



class LruModel:
    """What a tier must hold: keys in LRU order (least recent first) with their pins.

    Rules (both tiers): a put keeps present keys, fills FREE slots, then evicts unpinned keys
    not in the put, oldest first; keys that find no room are not stored. Every call then
    touches its blocks tail-first (the call's first block ends up most recent).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: OrderedDict[bytes, int] = OrderedDict()  # key -> pins

    def put(self, keys: list[bytes]) -> PutResult:
        unique = list(dict.fromkeys(keys))
        new = [k for k in unique if k not in self.order]
        room = self.capacity - len(self.order)
        candidates = [k for k, pins in self.order.items() if pins == 0 and k not in unique]
        victims = candidates[: max(0, len(new) - room)]
        for k in victims:
            del self.order[k]
        for k in new[: room + len(victims)]:
            self.order[k] = 0
        self._touch(unique)
        return PutResult([k in self.order for k in keys], victims)

    def get(self, keys: list[bytes]) -> list[bool]:
        self._touch(keys)
        return [k in self.order for k in keys]

    def pin(self, keys: list[bytes]) -> list[bool]:
        for k in keys:
            if k in self.order:
                self.order[k] += 1
        return [k in self.order for k in keys]

    def can_unpin(self, keys: list[bytes]) -> bool:
        return all(keys.count(k) <= self.order.get(k, 0) for k in set(keys))

    def unpin(self, keys: list[bytes]) -> None:
        for k in keys:
            self.order[k] -= 1

    def _touch(self, keys: list[bytes]) -> None:
        for k in reversed(keys):
            if k in self.order:
                self.order.move_to_end(k)


def random_ops(tier: BlockTier, model: LruModel, seed: int, steps: int, universe: int = 16) -> None:
    """`steps` random put/get/pin/unpin calls, each checked against the model and followed by
    check_integrity(); then every pin is returned and nothing may be left over."""
    rng = random.Random(seed)
    keys = [key(f"prop-{i}") for i in range(universe)]
    for _ in range(steps):
        batch = rng.choices(keys, k=rng.randint(0, 4))
        roll = rng.random()
        if roll < 0.40:
            assert tier.put(batch, blocks(batch)) == model.put(batch)
        elif roll < 0.70:
            _check_get(tier, model, batch)
        elif roll < 0.85:
            assert tier.pin(batch) == model.pin(batch)
        else:
            _random_unpin(tier, model, rng, batch)
        tier.check_integrity()
        assert tier.lru_order() == list(model.order)
    for k, pins in model.order.items():
        tier.unpin([k] * pins)
    tier.check_integrity()
    assert all(tier.pins(k) == 0 for k in keys)
    assert tier.num_used() == len(model.order)
    assert tier.num_free() == model.capacity - len(model.order)


def _check_get(tier: BlockTier, model: LruModel, batch: list[bytes]) -> None:
    dst = np.zeros((len(batch), SLOT_BYTES), np.uint8)
    hits = tier.get(batch, dst)
    assert hits == model.get(batch)
    for row, (k, hit) in enumerate(zip(batch, hits)):
        if hit:
            assert np.array_equal(dst[row], content(k))


def _random_unpin(tier: BlockTier, model: LruModel, rng: random.Random, batch: list[bytes]) -> None:
    pinned = [k for k, pins in model.order.items() if pins]
    if pinned and rng.random() < 0.8:
        batch = rng.sample(pinned, k=rng.randint(1, len(pinned)))
    if model.can_unpin(batch):
        tier.unpin(batch)
        model.unpin(batch)
    else:
        with pytest.raises(HashStateError):
            tier.unpin(batch)
