"""Catalogued faults of cache operations, each a policy handed to ropekv's engine.

Two kinds of policy, as for the other faults: a :class:`~ropekv.engine.rotation.RotationPolicy` subclass
for engines whose rotation offset an operation put out of step with the logical positions (it reads
the counts in ``StepContext.ops``), and a :class:`~ropekv.cache.policy.CacheOpPolicy` subclass for
what an operation does to stored keys. Listed by ``ropekv.faults.registry`` with the faults every
model can run (``--inject``, ``--list-faults``); each needs a case running its operation (``op``) to show.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..cache.policy import CacheOpPolicy, turn
from ..engine.rotation import RotationPolicy
from ..parity.cases import CacheOp
from .native import NativeFault


class _OffsetRotation(RotationPolicy):
    """Queries and new keys turn at ``position + offset(ctx)`` on the cached path."""

    def offset(self, ctx) -> int:
        raise NotImplementedError

    def query(self, rope, q, positions, ctx):
        return super().query(rope, q, positions + self.offset(ctx) if ctx.cached else positions, ctx)

    def write_key(self, rope, k, positions, slots, ctx):
        moved = positions + self.offset(ctx) if ctx.cached else positions
        return super().write_key(rope, k, moved, slots, ctx)


class RollbackOffset(_OffsetRotation):
    """After a rollback the offset still counts the rejected draft (mlx-vlm #1155)."""

    name = "rollback-offset"

    def offset(self, ctx):
        return ctx.ops.rolled_back


class EvictOffset(_OffsetRotation):
    """After an eviction the offset is the number of kept rows (VeloxQuant-MLX #138, #389)."""

    name = "evict-offset"

    def offset(self, ctx):
        return -ctx.ops.evicted


class PaddingOffset(_OffsetRotation):
    """A merged left-padded batch under one shared cursor: each row's query is off by its padding."""

    name = "padding-offset"

    def offset(self, ctx):
        return ctx.ops.padding


class RestoreWithoutPositions(_OffsetRotation):
    """A restored cache whose offset restarts at 0: the next token turns as if nothing was cached."""

    name = "restore-without-positions"

    def offset(self, ctx):
        return -ctx.ops.restored


class RollbackStaleRing(CacheOpPolicy):
    """Ring rollback moves positions back but leaves the rejected tokens' keys and values in the slots
    they overwrote (mlx-lm RotatingKVCache.trim, PRs #1427/#1486)."""

    name = "rollback-stale-ring"

    def ring_restore(self, journal, current, *, age):
        return current


class RollbackKeepsNewestSlot(CacheOpPolicy):
    """Ring rollback restores every slot the rejected draft overwrote except the newest one, whose
    rejected key and value stay in view (an off-by-one in the restore loop's range)."""

    name = "rollback-keeps-newest-slot"

    def ring_restore(self, journal, current, *, age):
        return current if age == 0 else journal


class EvictCompacts(CacheOpPolicy):
    """Eviction compacts the cache and renumbers the survivors 0..n-1 by their kept-row index: raw keys
    are then turned at those numbers on read, and the cache labels its keys with them."""

    name = "evict-compacts-positions"

    def survivor_positions(self, positions):
        return positions.argsort().argsort()


class EvictCompactsPositions(EvictOffset):
    """The rotation side of a compacting eviction: new tokens continue from the kept-row count."""


class ShiftNotRotated(CacheOpPolicy):
    """A shift relabels rotated keys without turning them."""

    name = "shift-not-rotated"

    def shift_keys(self, rope, keys, delta, key_form):
        return keys


class ShiftRotatesRaw(CacheOpPolicy):
    """A shift turns raw keys, which the reader turns again at their new positions."""

    name = "shift-rotates-raw"

    def shift_keys(self, rope, keys, delta, key_form):
        return turn(rope, keys, delta)


class ShiftTwice(CacheOpPolicy):
    """A shift's re-rotation runs twice (turned by R(2 delta)) while positions move once."""

    name = "shift-twice"

    def shift_keys(self, rope, keys, delta, key_form):
        return turn(rope, keys, 2 * delta) if key_form == "rotated" else keys


@dataclass(frozen=True, kw_only=True)
class OpFault(NativeFault):
    """A :class:`~ropekv.faults.native.NativeFault` that shows only in a case running ``op``;
    ``needs_window``: only where the ring has wrapped, too."""

    op: CacheOp
    needs_window: bool = False


CATALOGUE: tuple[OpFault, ...] = (
    OpFault(
        name="rollback-stale-ring",
        kind="rollback_stale_keys",
        description="ring rollback leaves the rejected draft's keys in its slots",
        key_form="rotated",
        shows_when="a rollback whose draft overwrote ring slots (a wrapped window)",
        op=CacheOp("rollback", 3),
        cache_ops=RollbackStaleRing,
        needs_window=True,
    ),
    OpFault(
        name="rollback-keeps-newest-slot",
        kind="rollback_stale_keys",
        description="ring rollback restores every overwritten slot but the newest",
        key_form="rotated",
        shows_when="a rollback whose draft overwrote ring slots (a wrapped window)",
        op=CacheOp("rollback", 3),
        cache_ops=RollbackKeepsNewestSlot,
        needs_window=True,
    ),
    OpFault(
        name="rollback-offset",
        kind="rollback_offset",
        description="rollback leaves the offset advanced by the draft length",
        key_form="rotated",
        shows_when="any rollback",
        op=CacheOp("rollback", 3),
        rotation=RollbackOffset,
    ),
    OpFault(
        name="evict-offset",
        kind="evict_offset",
        description="eviction resets the offset to the kept-row count",
        key_form="rotated",
        shows_when="any eviction",
        op=CacheOp("evict", 5),
        rotation=EvictOffset,
    ),
    OpFault(
        name="evict-compacts-positions",
        kind="evict_offset",
        description="eviction renumbers the survivors 0..n-1 (compaction) and continues from the kept count",
        key_form="raw",
        shows_when="any eviction of raw keys",
        op=CacheOp("evict", 4),
        rotation=EvictCompactsPositions,
        cache_ops=EvictCompacts,
        fixed_key_form=True,
    ),
    OpFault(
        name="shift-not-rotated",
        kind="shift_not_rotated",
        description="shift relabels rotated keys without turning them",
        key_form="rotated",
        shows_when="a shift of rotated keys",
        op=CacheOp("shift", 100),
        cache_ops=ShiftNotRotated,
        fixed_key_form=True,
    ),
    OpFault(
        name="shift-rotates-raw",
        kind="shift_rotated_raw",
        description="shift turns raw keys the reader turns again",
        key_form="raw",
        shows_when="a shift of raw keys",
        op=CacheOp("shift", 100),
        cache_ops=ShiftRotatesRaw,
        fixed_key_form=True,
    ),
    OpFault(
        name="shift-twice",
        kind="shift_applied_twice",
        description="shift turns rotated keys twice",
        key_form="rotated",
        shows_when="a shift of rotated keys",
        op=CacheOp("shift", 100),
        cache_ops=ShiftTwice,
        fixed_key_form=True,
    ),
    OpFault(
        name="padding-offset",
        kind="padding_offset",
        description="merged left-padded batch decoded under one shared cursor",
        key_form="rotated",
        shows_when="a batch of different lengths",
        op=CacheOp("batch", 3),
        rotation=PaddingOffset,
    ),
    OpFault(
        name="restore-without-positions",
        kind="restore_offset_lost",
        description="restored cache decoded with its offset back at 0",
        key_form="rotated",
        shows_when="any restore",
        op=CacheOp("restore"),
        rotation=RestoreWithoutPositions,
    ),
)
