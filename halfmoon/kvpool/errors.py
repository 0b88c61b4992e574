"""Precise exception types raised by the KV block pool.

Every class pickles back to itself (Ray ships exceptions between actors): the ones that carry
fields are `core.errors.StructuredError`s.
"""

from __future__ import annotations

from halfmoon.core.errors import StructuredError


class KVPoolError(Exception):
    """Base of every error the KV pool raises on purpose."""


class OutOfBlocksError(StructuredError, KVPoolError):
    """More blocks were requested than are free; the pool was left unchanged."""

    requested: int
    free: int
    fields = ("requested", "free")
    template = "requested {requested} KV blocks but only {free} are free"


class UnknownBlockError(StructuredError, KVPoolError, ValueError):
    """A block id outside 0..num_blocks-1 (or not an int) was passed to the pool."""

    block_id: object
    num_blocks: int
    fields = ("block_id", "num_blocks")

    def describe(self) -> str:
        return f"block id {self.block_id!r} is not in 0..{self.num_blocks - 1}"


class BlockStateError(StructuredError, KVPoolError):
    """A block is in the wrong state for the operation (double free, incref of a free block)."""

    block_id: int
    message: str
    fields = ("block_id", "message")
    template = "block {block_id}: {message}"


class BadBlockHashError(KVPoolError, ValueError):
    """A block hash that is not `bytes` of length `kvpool.block_hash.HASH_BYTES`."""


class PoolIntegrityError(KVPoolError):
    """The pool's bookkeeping is inconsistent: always a bug, never a caller mistake."""


class HashStateError(StructuredError, KVPoolError):
    """A block hash is in the wrong state for a tier operation (e.g. unpin of an unpinned block);
    the tier was left unchanged."""

    block_hash: bytes
    message: str
    fields = ("block_hash", "message")

    def describe(self) -> str:
        return f"block {self.block_hash.hex()}: {self.message}"


class TierClosedError(KVPoolError):
    """A host or disk tier handle was used after `close()`."""


class TierLayoutError(KVPoolError):
    """A shared-memory arena or on-disk slab has an unexpected layout, size or version."""
