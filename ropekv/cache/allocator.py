"""Block allocator: a free list and reference counts, no tensors (like vLLM's ``BlockPool``).

Blocks are integer ids ``0 .. num_blocks - 1``. A block is free at refcount 0; sharing a block between
sequences (a prefix fork) increments its count, and it returns to the free list when the last holder
lets go. Allocation is deterministic: the lowest free id first.
"""

from __future__ import annotations

import heapq

from ..errors import CapacityError, UsageError


class AllocatorInvariantError(RuntimeError):
    """A caller bug (decref of a free block, an id out of range). Deliberately not a RopeKVError:
    it is never the user's fault, so it should surface with a traceback."""


class BlockAllocator:
    """Hands out block ids and counts their holders."""

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise UsageError(f"num_blocks must be an integer >= 0, got {num_blocks!r}")
        self._refcounts = [0] * num_blocks
        self._free = list(range(num_blocks))  # a heap; sorted is a valid heap

    @property
    def num_blocks(self) -> int:
        return len(self._refcounts)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """The lowest free block, now with refcount 1. Raises CapacityError when none is free."""
        if not self._free:
            raise CapacityError(f"no free block: all {self.num_blocks} blocks are in use")
        block = heapq.heappop(self._free)
        self._refcounts[block] = 1
        return block

    def allocate_many(self, n: int) -> list[int]:
        """``n`` blocks, or CapacityError and nothing allocated."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise UsageError(f"allocate_many needs an integer n >= 0, got {n!r}")
        if n > len(self._free):
            raise CapacityError(f"{n} blocks needed, {len(self._free)} of {self.num_blocks} free")
        return [self.allocate() for _ in range(n)]

    def incref(self, block: int) -> None:
        """One more holder of an allocated block."""
        self._check_in_use(block, "incref")
        self._refcounts[block] += 1

    def decref(self, block: int) -> int:
        """One holder fewer; at 0 the block is free again. Returns the new count."""
        self._check_in_use(block, "decref")
        self._refcounts[block] -= 1
        if self._refcounts[block] == 0:
            heapq.heappush(self._free, block)
        return self._refcounts[block]

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._refcounts[block]

    def refcounts(self) -> tuple[int, ...]:
        """Every block's count; the whole allocator state (free = count 0)."""
        return tuple(self._refcounts)

    def _check_id(self, block: int) -> None:
        if not isinstance(block, int) or isinstance(block, bool) or not 0 <= block < self.num_blocks:
            raise AllocatorInvariantError(f"block id {block!r} out of range [0, {self.num_blocks})")

    def _check_in_use(self, block: int, op: str) -> None:
        self._check_id(block)
        if self._refcounts[block] == 0:
            raise AllocatorInvariantError(f"internal error: {op} of free block {block}")
