"""Precise exception types raised by the KV block pool.

Every class pickles back to itself (Ray ships exceptions between actors), so the ones that carry
fields define `__reduce__`.
"""

from __future__ import annotations


class KVPoolError(Exception):
    """Base of every error the KV pool raises on purpose."""


class OutOfBlocksError(KVPoolError):
    """More blocks were requested than are free; the pool was left unchanged."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"requested {requested} KV blocks but only {free} are free")
        self.requested = requested
        self.free = free

    def __reduce__(self) -> tuple[type[OutOfBlocksError], tuple[int, int]]:
        return (type(self), (self.requested, self.free))


class UnknownBlockError(KVPoolError, ValueError):
    """A block id outside 0..num_blocks-1 (or not an int) was passed to the pool."""

    def __init__(self, block_id: object, num_blocks: int) -> None:
        super().__init__(f"block id {block_id!r} is not in 0..{num_blocks - 1}")
        self.block_id = block_id
        self.num_blocks = num_blocks

    def __reduce__(self) -> tuple[type[UnknownBlockError], tuple[object, int]]:
        return (type(self), (self.block_id, self.num_blocks))


class BlockStateError(KVPoolError):
    """A block is in the wrong state for the operation (double free, incref of a free block)."""

    def __init__(self, block_id: int, message: str) -> None:
        super().__init__(f"block {block_id}: {message}")
        self.block_id = block_id
        self.message = message

    def __reduce__(self) -> tuple[type[BlockStateError], tuple[int, str]]:
        return (type(self), (self.block_id, self.message))


class BadBlockHashError(KVPoolError, ValueError):
    """A block hash that is not `bytes` of length `kvpool.block_hash.HASH_BYTES`."""


class PoolIntegrityError(KVPoolError):
    """The pool's bookkeeping is inconsistent: always a bug, never a caller mistake."""


class HashStateError(KVPoolError):
    """A block hash is in the wrong state for a tier operation (e.g. unpin of an unpinned block);
    the tier was left unchanged."""

    def __init__(self, block_hash: bytes, message: str) -> None:
        super().__init__(f"block {block_hash.hex()}: {message}")
        self.block_hash = block_hash
        self.message = message

    def __reduce__(self) -> tuple[type[HashStateError], tuple[bytes, str]]:
        return (type(self), (self.block_hash, self.message))


class TierClosedError(KVPoolError):
    """A host or disk tier handle was used after `close()`."""


class TierLayoutError(KVPoolError):
    """A shared-memory arena or on-disk slab has an unexpected layout, size or version."""
