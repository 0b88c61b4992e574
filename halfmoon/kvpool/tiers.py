"""Storage tiers of a KV block, fastest first.

The integer value is the tier's rank: a smaller value is a faster tier, so `min()` over tiers is
the best copy and `max()` the slowest copy a reader would have to touch.
"""

from __future__ import annotations

from enum import IntEnum


class Tier(IntEnum):
    """Where a holder keeps a KV block."""

    DEVICE = 0  # accelerator (or the CPU runner's) paged KV tensor
    HOST = 1  # shared-memory DRAM arena of the node
    DISK = 2  # NVMe slab files

    @property
    def bit(self) -> int:
        """This tier's bit in a tier mask (DEVICE=1, HOST=2, DISK=4)."""
        return 1 << self.value
