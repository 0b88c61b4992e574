"""Device KV block pool: hands out block ids 0..num_blocks-1 with reference counts.

The paged KV tensor lives elsewhere; a request's block table is a list of ids from this pool.
The layout follows vLLM v1 so prefix caching can be added without a rewrite:

* every block has one `KVBlock` record, created once and never reallocated;
* free blocks sit in an intrusive doubly linked `FreeBlockQueue` whose order is the eviction
  order (head = reused first), so a cached-but-free block can later be pulled out of the middle
  in O(1) when a new request hits its hash;
* a block's old contents are discarded only when it is popped for reuse (`_take_free`), the
  point where prefix caching will drop the block's hash (lazy eviction).

Invariant (checked by `BlockPool.check_integrity`): a block is in the free queue exactly when its
`ref_cnt` is 0, and then it is in it once.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from halfmoon.kvpool.errors import (
    BlockStateError,
    OutOfBlocksError,
    PoolIntegrityError,
    UnknownBlockError,
)

# Id of the free queue's two sentinel records; they are never handed out or listed.
_SENTINEL_ID = -1


@dataclass(slots=True, eq=False)
class KVBlock:
    """Bookkeeping of one device KV block. Compared by identity (`eq=False`): the links make
    records cyclic, so field-wise equality and repr would recurse."""

    block_id: int
    ref_cnt: int = 0
    # Chained hash of the block's full token contents once it is registered in the prefix cache.
    block_hash: bytes | None = None
    # Free-queue links: both None exactly when the block is in no queue.
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks, in eviction order (head is reused first).

        head sentinel <-> b_0 <-> b_1 <-> ... <-> b_k <-> tail sentinel

    Unlike `collections.deque` it removes a block from the middle in O(1), and no operation
    allocates: only the blocks' own `prev_free`/`next_free` links are rewired. The sentinels
    remove every empty-queue and end-of-queue special case.
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(block_id=_SENTINEL_ID)
        self._tail = KVBlock(block_id=_SENTINEL_ID)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> KVBlock:
        """Unlink and return the head block (the next eviction candidate)."""
        first = self._head.next_free
        if first is None or first is self._tail:
            raise IndexError("popleft from an empty FreeBlockQueue")
        self.remove(first)
        return first

    def remove(self, block: KVBlock) -> None:
        """Unlink `block` from wherever it is in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise BlockStateError(block.block_id, "is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def append(self, block: KVBlock) -> None:
        """Link `block` at the tail (evicted last)."""
        last = self._tail.prev_free
        assert last is not None, "the tail sentinel always has a predecessor"
        self._insert_after(last, block)

    def appendleft(self, block: KVBlock) -> None:
        """Link `block` at the head (evicted first)."""
        self._insert_after(self._head, block)

    def ids(self) -> list[int]:
        """Block ids from head to tail (for tests and debugging; O(len))."""
        return [block.block_id for block in self.walk(limit=self._len)]

    def walk(self, limit: int, reverse: bool = False) -> list[KVBlock]:
        """Blocks head→tail (or tail→head), checking that every link has its back link.

        Raises PoolIntegrityError on a broken link or after more than `limit` blocks (a cycle).
        """
        node, end = (self._tail, self._head) if reverse else (self._head, self._tail)
        blocks: list[KVBlock] = []
        while True:
            nxt = node.prev_free if reverse else node.next_free
            if nxt is None:
                raise PoolIntegrityError(f"free queue link broken after block {node.block_id}")
            back = nxt.next_free if reverse else nxt.prev_free
            if back is not node:
                raise PoolIntegrityError(
                    f"free queue link {node.block_id} -> {nxt.block_id} has no back link"
                )
            if nxt is end:
                return blocks
            if len(blocks) == limit:
                raise PoolIntegrityError(f"free queue walk passed {limit} blocks (a cycle?)")
            blocks.append(nxt)
            node = nxt

    def _insert_after(self, prev: KVBlock, block: KVBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise BlockStateError(block.block_id, "is already in a free queue")
        nxt = prev.next_free
        assert nxt is not None, "every linked node but the tail sentinel has a successor"
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1


class BlockPool:
    """Reference-counted allocator of device KV block ids 0..num_blocks-1.

    Allocation pops the free queue's head, so a fresh pool hands out 0, 1, 2, ... and the order
    is deterministic. Every verb validates all its arguments before mutating anything: when it
    raises, the pool is unchanged.
    """

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self._blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
        self._free = FreeBlockQueue(self._blocks)
        # Prefix cache: hash -> the one block holding those tokens, used or cached-but-free.
        self._cached: dict[bytes, KVBlock] = {}
        # Called as on_evict(block_id, block_hash) right before a cached block's contents die,
        # while its bytes are still intact: the hook that demotes blocks to the host tier.
        self.on_evict: Callable[[int, bytes], None] | None = None
        self.num_evictions = 0

    def __repr__(self) -> str:
        return f"BlockPool(num_blocks={self.num_blocks}, free={self.num_free()})"

    @property
    def num_blocks(self) -> int:
        """Total number of blocks, free or used."""
        return len(self._blocks)

    def num_free(self) -> int:
        """Blocks with ref_cnt 0 (all in the free queue)."""
        return len(self._free)

    def num_used(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        """Whether `allocate(n)` would succeed now."""
        _check_count(n)
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the head of the free queue, each with ref_cnt 1.

        Raises OutOfBlocksError (pool unchanged) when fewer than `n` are free.
        """
        _check_count(n)
        if n > len(self._free):
            raise OutOfBlocksError(requested=n, free=len(self._free))
        return [self._take_free().block_id for _ in range(n)]

    def incref(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block, e.g. when another request shares a prefix.

        Only used blocks can be shared; a free block raises BlockStateError (pool unchanged).
        """
        blocks = self._lookup(block_ids)
        for block in blocks:
            if block.ref_cnt == 0:
                raise BlockStateError(block.block_id, "is free; only used blocks can be increfed")
        for block in blocks:
            block.ref_cnt += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block of a request's block table, given in table order.

        Blocks reaching ref_cnt 0 return to the free queue. Freeing more references than a
        block holds (a double free) raises BlockStateError and leaves the pool unchanged.
        """
        blocks = self._lookup(block_ids)
        self._check_releasable(blocks)
        # The free queue is the eviction order: its head is reused first. A request's tail blocks
        # are the least shareable (another request can only share a block if it shares the whole
        # prefix up to it), so they are appended first and hence evicted first, while the head
        # blocks (system prompts, shared prefixes) stay in the pool longest. E.g. freeing a
        # table [a, b, c] appends c, b, a: the next allocations reuse c, then b, then a.
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free.append(block)

    def ref_cnt(self, block_id: int) -> int:
        """Number of requests holding `block_id` (0 when free)."""
        return self._block(block_id).ref_cnt

    def check_integrity(self) -> None:
        """Raise PoolIntegrityError unless the bookkeeping is consistent.

        O(num_blocks); for tests and debug builds, not the hot path.
        """
        try:
            queued = self._check_free_queue()
            used = self._check_block_states(queued)
        except PoolIntegrityError as err:
            raise self._integrity_error(str(err)) from err
        if len(queued) + used != self.num_blocks:
            raise self._integrity_error(
                f"free ({len(queued)}) + used ({used}) != total ({self.num_blocks})"
            )
        try:
            self._check_prefix_cache()
        except PoolIntegrityError as err:
            raise self._integrity_error(str(err)) from err

    def _check_prefix_cache(self) -> None:
        """Every registered hash maps to a block carrying it, and vice versa."""
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash or self._blocks[block.block_id] is not block:
                raise PoolIntegrityError(f"prefix cache entry for block {block.block_id} is stale")
        carrying = sum(1 for block in self._blocks if block.block_hash is not None)
        if carrying != len(self._cached):
            raise PoolIntegrityError(
                f"{carrying} blocks carry a hash but the prefix cache has {len(self._cached)}"
            )

    # ------------------------------------------------------------ prefix cache

    def cached_hashes(self) -> list[bytes]:
        """The hashes the prefix cache holds (used blocks and cached-but-free ones)."""
        return list(self._cached)

    def num_cached(self) -> int:
        """Blocks registered under a hash (used, or free but still holding their tokens)."""
        return len(self._cached)

    def get_computed_blocks(self, hashes: Sequence[bytes]) -> list[int]:
        """Ids of the longest prefix of `hashes` cached on this device; takes no reference."""
        found: list[int] = []
        for block_hash in hashes:
            block = self._cached.get(block_hash)
            if block is None:
                break
            found.append(block.block_id)
        return found

    def num_free_among(self, block_ids: Sequence[int]) -> int:
        """How many of these (cached) blocks are free now, i.e. would leave the free queue on touch."""
        return sum(1 for block in self._lookup(block_ids) if block.ref_cnt == 0)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one reference to each cached block a new request reuses.

        A cached-but-free block leaves the free queue (O(1), from anywhere in it).
        """
        blocks = self._lookup(block_ids)
        for block in blocks:
            if block.block_hash is None:
                raise BlockStateError(block.block_id, "is not in the prefix cache")
        for block in blocks:
            if block.ref_cnt == 0:
                self._free.remove(block)
            block.ref_cnt += 1

    def cache_blocks(self, block_ids: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Register full, computed, used blocks under their hashes (the first holder of a hash wins).

        Invariant: a registered block's bytes are exactly the KV of its hash's tokens, so a block
        is only ever registered once its last token's KV has been written.
        """
        blocks = self._lookup(block_ids)
        if len(blocks) != len(hashes):
            raise ValueError(f"{len(blocks)} blocks but {len(hashes)} hashes")
        for block, block_hash in zip(blocks, hashes):
            if block.ref_cnt == 0:
                raise BlockStateError(block.block_id, "is free; only used blocks can be cached")
            if block.block_hash is not None:
                if block.block_hash != block_hash:
                    raise BlockStateError(block.block_id, "is already cached under another hash")
                continue
            if block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block

    def _take_free(self) -> KVBlock:
        # The only place a free block is reused, so the only place its old contents die: the
        # prefix cache un-registers the block's hash here (lazy eviction), not when it was freed.
        block = self._free.popleft()
        if block.block_hash is not None:
            self._evict(block)
        block.ref_cnt = 1
        return block

    def _evict(self, block: KVBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        if self.on_evict is not None:
            self.on_evict(block.block_id, block_hash)
        del self._cached[block_hash]
        block.block_hash = None
        self.num_evictions += 1

    def _block(self, block_id: int) -> KVBlock:
        try:
            index = operator.index(block_id)
        except TypeError:
            raise UnknownBlockError(block_id, self.num_blocks) from None
        # Explicit range check: a negative index would silently wrap around in Python.
        if not 0 <= index < len(self._blocks):
            raise UnknownBlockError(block_id, self.num_blocks)
        return self._blocks[index]

    def _lookup(self, block_ids: Sequence[int]) -> list[KVBlock]:
        return [self._block(block_id) for block_id in block_ids]

    def _check_releasable(self, blocks: list[KVBlock]) -> None:
        # Count occurrences so a table listing a block twice cannot drive ref_cnt below 0.
        for block, times in Counter(blocks).items():
            if block.ref_cnt == 0:
                raise BlockStateError(block.block_id, "double free (ref_cnt is already 0)")
            if times > block.ref_cnt:
                raise BlockStateError(
                    block.block_id, f"freed {times} times but ref_cnt is {block.ref_cnt}"
                )

    def _check_free_queue(self) -> set[int]:
        """Walk the queue both ways; return the ids it holds."""
        forward = self._free.walk(limit=self.num_blocks)
        backward = self._free.walk(limit=self.num_blocks, reverse=True)
        if not len(forward) == len(backward) == len(self._free):
            raise PoolIntegrityError(
                f"free queue walks {len(forward)} blocks forward and {len(backward)} backward "
                f"but its length is {len(self._free)}"
            )
        if any(a is not b for a, b in zip(forward, reversed(backward), strict=True)):
            raise PoolIntegrityError("free queue walks differ forward and backward")
        ids = {block.block_id for block in forward}
        if len(ids) != len(forward):
            raise PoolIntegrityError("free queue holds a block id twice")
        for block in forward:
            own = 0 <= block.block_id < self.num_blocks and self._blocks[block.block_id] is block
            if not own:
                raise PoolIntegrityError(f"free queue holds a foreign block {block.block_id}")
        return ids

    def _check_block_states(self, queued: set[int]) -> int:
        """Check every block against the free queue's membership; return the used count."""
        used = 0
        for index, block in enumerate(self._blocks):
            if block.block_id != index:
                raise PoolIntegrityError(f"block at index {index} has id {block.block_id}")
            if index in queued:
                if block.ref_cnt != 0:
                    raise PoolIntegrityError(f"free block {index} has ref_cnt {block.ref_cnt}")
                continue
            if block.ref_cnt <= 0:
                raise PoolIntegrityError(
                    f"block {index} is not in the free queue but has ref_cnt {block.ref_cnt}"
                )
            if block.prev_free is not None or block.next_free is not None:
                raise PoolIntegrityError(f"used block {index} still has free-queue links")
            used += 1
        return used

    def _integrity_error(self, message: str) -> PoolIntegrityError:
        used = sum(1 for block in self._blocks if block.ref_cnt > 0)
        return PoolIntegrityError(
            f"{message} [free queue length {len(self._free)}, blocks with ref_cnt > 0 {used}, "
            f"total {self.num_blocks}]"
        )


def _check_count(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"block count must be a non-negative int, got {n!r}")
