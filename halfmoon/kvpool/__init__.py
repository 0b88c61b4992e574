"""kvpool: device KV block accounting.

`BlockPool` hands out reference-counted block ids 0..num_blocks-1 for request block tables; its
free blocks live in a `FreeBlockQueue` whose order is the eviction order. The paged KV tensor the
ids index lives with the model runner, not here.
"""

from halfmoon.kvpool.block_pool import BlockPool, FreeBlockQueue, KVBlock
from halfmoon.kvpool.errors import (
    BlockStateError,
    KVPoolError,
    OutOfBlocksError,
    PoolIntegrityError,
    UnknownBlockError,
)

__all__ = [
    "BlockPool",
    "BlockStateError",
    "FreeBlockQueue",
    "KVBlock",
    "KVPoolError",
    "OutOfBlocksError",
    "PoolIntegrityError",
    "UnknownBlockError",
]
