"""BlockAllocator: free list, reference counts, all-or-nothing allocation, deterministic order."""

import pytest

from ropekv.cache.allocator import AllocatorInvariantError, BlockAllocator
from ropekv.errors import CapacityError, UsageError


def test_allocates_lowest_free_first_and_reuses_freed_blocks():
    a = BlockAllocator(4)
    assert (a.num_blocks, a.num_free) == (4, 4)
    assert [a.allocate() for _ in range(3)] == [0, 1, 2]
    assert a.num_free == 1
    assert a.decref(1) == 0
    assert a.num_free == 2
    assert a.allocate() == 1  # lowest free id, not the most recently freed order
    assert a.allocate() == 3


def test_refcounts_keep_shared_blocks_until_the_last_holder_lets_go():
    a = BlockAllocator(2)
    b = a.allocate()
    a.incref(b)
    a.incref(b)
    assert a.refcount(b) == 3
    assert a.decref(b) == 2
    assert a.decref(b) == 1
    assert a.num_free == 1
    assert a.decref(b) == 0
    assert a.num_free == 2
    assert a.refcounts() == (0, 0)


def test_exhaustion_raises_capacity_error():
    a = BlockAllocator(2)
    a.allocate(), a.allocate()
    with pytest.raises(CapacityError, match="no free block"):
        a.allocate()


def test_allocate_many_is_all_or_nothing():
    a = BlockAllocator(5)
    a.allocate()
    with pytest.raises(CapacityError, match="5 blocks needed, 4 of 5 free"):
        a.allocate_many(5)
    assert a.num_free == 4 and a.refcounts() == (1, 0, 0, 0, 0)
    assert a.allocate_many(4) == [1, 2, 3, 4]
    assert a.allocate_many(0) == []
    assert a.num_free == 0


@pytest.mark.parametrize("op", ["decref", "incref"])
def test_operations_on_free_blocks_are_internal_errors(op):
    a = BlockAllocator(3)
    with pytest.raises(AllocatorInvariantError, match=f"{op} of free block 1"):
        getattr(a, op)(1)
    b = a.allocate()
    a.decref(b)
    with pytest.raises(AllocatorInvariantError):
        a.decref(b)


@pytest.mark.parametrize("block", [-1, 3, 100, True])
def test_out_of_range_ids_are_internal_errors(block):
    a = BlockAllocator(3)
    with pytest.raises(AllocatorInvariantError, match="out of range"):
        a.refcount(block)


@pytest.mark.parametrize("bad", [-1, 2.0, "4", True])
def test_bad_sizes_are_usage_errors(bad):
    with pytest.raises(UsageError):
        BlockAllocator(bad)
    with pytest.raises(UsageError):
        BlockAllocator(4).allocate_many(bad)


def test_empty_pool():
    a = BlockAllocator(0)
    assert a.num_free == 0
    with pytest.raises(CapacityError):
        a.allocate()
