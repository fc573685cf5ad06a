"""Where a cached token lives: the cache's layer groups and their slot rule, the head-major pool
layout, and the cache's records (a sequence's state, its overwrite journal, a reservation).

Layers are grouped by attention kind, named as :class:`~ropekv.attention_kind.LayerAttention` names
them: the ``"sliding"`` group holds the windowed layers (``contract.window_layers``), the ``"full"``
group every other layer. Chunked layers live in the full group: every key stays cached, and the
engine's mask hides the keys of earlier chunks. A sequence's ``n``-th appended token (write index
``n``) goes to

- full group: ``slot = n``;
- sliding group (window W, sinks S): ``slot = n if n < S else S + (n - S) % W``, a ring of S + W slots.

Physical location: block ``table[slot // block_size]``, offset ``slot % block_size``. Slots wrap, logical
positions keep increasing: positions are *stored* per slot and never derived from the slot
(the "slot as position" bug, docs/contract.md).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..attention_kind import LayerAttention
from ..contract import CacheContract
from .allocator import BlockAllocator

CacheGroup = Literal["full", "sliding"]  # the attention kinds with a group of their own


def group_of(kind: LayerAttention) -> CacheGroup:
    """The cache group of a layer of ``kind``. Chunked layers are full: every key stays cached (the
    mask hides the keys of earlier chunks)."""
    return "sliding" if kind.kind == "sliding" else "full"


@dataclass(frozen=True)
class KVView:
    """The live tokens of one sequence in one layer, in position order. Read-only."""

    keys: torch.Tensor  # [N, num_kv_heads, head_dim], contract dtype
    values: torch.Tensor  # [N, num_kv_heads, head_dim]
    positions: torch.Tensor  # [N] int64, logical positions, strictly increasing
    slots: torch.Tensor  # [N] int64, slot of each token within the sequence (never a position)


class Group:
    """Layers of one attention kind: their allocator, slot rule and per-slot positions."""

    def __init__(
        self,
        name: CacheGroup,
        layers: tuple[int, ...],
        window: int | None,
        sinks: int,
        num_blocks: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.name, self.layers, self.window, self.sinks = name, layers, window, sinks
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.positions = torch.full((num_blocks, block_size), -1, dtype=torch.int64, device=device)

    @property
    def ring(self) -> int | None:
        """Slots of the ring (S + W), or None for an unbounded full-attention table."""
        return None if self.window is None else self.sinks + self.window

    def slots(self, index: torch.Tensor) -> torch.Tensor:
        """Slot of each write index ``[k]`` -> ``[k]``."""
        if self.window is None:
            return index
        s = self.sinks
        return torch.where(index < s, index, s + (index - s) % self.window)

    def num_slots(self, num_tokens: int) -> int:
        """Slots a sequence of ``num_tokens`` tokens occupies."""
        return num_tokens if self.ring is None else min(num_tokens, self.ring)

    def live(self, num_tokens: int) -> torch.Tensor:
        """Write indices whose token is live after ``num_tokens`` appends, ascending ``[N]`` int64."""
        if self.window is None or self.ring is None or num_tokens <= self.ring:
            return torch.arange(num_tokens, dtype=torch.int64)
        sinks = torch.arange(min(self.sinks, num_tokens), dtype=torch.int64)
        recent = torch.arange(max(self.sinks, num_tokens - self.window), num_tokens, dtype=torch.int64)
        return torch.cat((sinks, recent))

    def survivors(self, start: int, n: int) -> torch.Tensor:
        """Rows of a chunk of ``n`` tokens from write index ``start`` whose slot no later row of the
        chunk overwrites (all of them unless the chunk is longer than the ring), ``[k]`` int64."""
        rows = torch.arange(n, dtype=torch.int64)
        if self.window is None:
            return rows
        index = rows + start
        return rows[(index < self.sinks) | (index >= start + n - self.window)]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-self.num_slots(num_tokens) // self.block_size)


@dataclass(frozen=True, eq=False)
class Overwrite:
    """Journal entry: the ring slot token ``index`` overwrote, and what it held before (all sliding layers)."""

    index: int  # write index of the overwriting token
    slot: int
    position: int  # the slot's stored position before (-1: it was a hole)
    keys: torch.Tensor  # [sliding layers, KVH, D]
    values: torch.Tensor  # [sliding layers, KVH, D]


@dataclass
class SeqState:
    """One sequence's bookkeeping: its length, block tables, positions history and overwrite journal."""

    num_tokens: int = 0
    last_position: int = -1
    tables: dict[CacheGroup, list[int]] = field(default_factory=dict)  # group name -> block ids
    history: list[int] = field(default_factory=list)  # logical position of every write index (holes included)
    journal: list[Overwrite] = field(default_factory=list)  # ring overwrites of the last rollback_depth tokens
    inherited: int = 0  # tokens reused from a prefix-cache hit (the first ``inherited`` write indices)


@dataclass(frozen=True, eq=False)
class Reservation:
    """Blocks held for a sequence being written straight into the pool (``PagedKVCache.reserve``,
    :mod:`ropekv.cache.reserve`).

    ``rows[group]``: ``[N]`` int64 rows of the live tokens (position order) in the pools of that
    group's layers, seen as ``[num_blocks * block_size, KVH * D]``."""

    seq_id: Hashable
    num_tokens: int
    tables: dict[CacheGroup, list[int]]
    rows: dict[CacheGroup, torch.Tensor]


def head_major_pool(num_blocks: int, c: CacheContract, device: torch.device) -> torch.Tensor:
    """One layer's pool, indexed ``[num_blocks, block_size, KVH, D]`` but laid out head-major in
    memory (a ``[KVH, num_blocks * block_size, D]`` buffer, permuted): each KV head's keys of a run
    of consecutive rows are one contiguous ``[N, D]`` matrix, as in transformers' ``[B, KVH, N, D]``
    cache. Why: a decode step's attention reads every cached key and value once per layer, and
    MKL's matmuls run about twice as fast over a contiguous per-head matrix as over one whose rows
    lie ``KVH * D`` apart (docs/performance.md: 36 vs 19 ms a step at 4,096 tokens, one thread)."""
    rows = num_blocks * c.block_size
    store = torch.zeros((c.num_kv_heads, rows, c.head_dim), dtype=c.torch_dtype, device=device)
    return store.permute(1, 0, 2).view(num_blocks, c.block_size, c.num_kv_heads, c.head_dim)


def window_rows(num_tokens: int, window: int, sinks: int) -> torch.Tensor:
    """Write indices a sliding ring (``sinks`` + ``window`` slots) still holds after ``num_tokens``
    appends, ascending ``[rows]`` int64 -- the same rule as ``PagedKVCache``'s sliding group."""
    if num_tokens <= sinks + window:
        return torch.arange(num_tokens, dtype=torch.int64)
    return torch.cat(
        (torch.arange(sinks, dtype=torch.int64), torch.arange(num_tokens - window, num_tokens, dtype=torch.int64))
    )


def pool_rows(pool: torch.Tensor) -> torch.Tensor:
    """A layer's pool as the rows ``[num_blocks * block_size, KVH, D]`` that
    :meth:`PagedKVCache.flat_rows` indexes (a strided view: row ``r`` of head ``h`` is ``[r, h]``)."""
    return pool.view(pool.shape[0] * pool.shape[1], *pool.shape[2:])


def put_rows(pool: torch.Tensor, flat: torch.Tensor, src: torch.Tensor) -> None:
    """Write ``src [k, KVH, D]`` (the pool's dtype) into ``pool``'s rows ``flat [k]``
    (:func:`pool_rows`). An 8-bit pool is written through byte views: torch has no ``index_copy_``
    for float8 on CPU, and the bytes are the codes."""
    rows = pool_rows(pool)
    if rows.dtype.itemsize == 1:
        rows.view(torch.uint8).index_copy_(0, flat, src.contiguous().view(torch.uint8))
    else:
        rows.index_copy_(0, flat, src)


def head_rows(pool: torch.Tensor) -> torch.Tensor:
    """A layer's pool as its head-major buffer ``[KVH, num_blocks * block_size, D]`` (a contiguous
    view): ``head_rows(pool)[h, a:b]`` is one contiguous ``[b - a, D]`` run, what a transport sends
    and receives in place."""
    return pool_rows(pool).permute(1, 0, 2)
