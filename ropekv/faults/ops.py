"""Catalogued faults of cache operations, each a policy handed to ropekv's engine.

Two kinds of policy, as for the other faults: a :class:`~ropekv.engine.rotation.RotationPolicy` subclass
for engines whose rotation offset an operation put out of step with the logical positions (it reads
the counts in ``StepContext.ops``), and a :class:`~ropekv.cache.policy.CacheOpPolicy` subclass for
what an operation does to stored keys. Registered into ``ropekv.faults.catalogue.FAULTS`` (``--inject``,
``--list-faults``); each needs a case running its operation (``op``) to show.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..adapters.native import NativeAdapter
from ..cache.policy import CacheOpPolicy, turn
from ..engine.rotation import RotationPolicy
from ..models.config import Checkpoint
from ..parity.cases import CacheOp


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

    def ring_restore(self, journal, current):
        return current


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


@dataclass(frozen=True)
class OpFault:
    """A catalogued operation fault; same reading as :class:`ropekv.faults.catalogue.Fault`, plus ``op``."""

    name: str
    kind: str
    description: str
    key_form: str
    shows_when: str
    op: CacheOp
    rotation: Callable[[], RotationPolicy] | None = None
    cache_ops: Callable[[], CacheOpPolicy] | None = None
    fixed_key_form: bool = False
    needs_window: bool = False  # shows only where the ring has wrapped

    def adapter(self, checkpoint: Checkpoint, *, dtype: str = "float32", key_form: str | None = None) -> NativeAdapter:
        form = self.key_form if self.fixed_key_form else (key_form or self.key_form)
        return NativeAdapter(
            checkpoint,
            key_form=form,
            dtype=dtype,
            rotation=self.rotation() if self.rotation else None,
            cache_ops=self.cache_ops() if self.cache_ops else None,
            name=f"ropekv engine with fault {self.name}",
        )


OP_FAULTS: dict[str, OpFault] = {
    f.name: f
    for f in (
        OpFault(
            "rollback-stale-ring",
            "rollback_stale_keys",
            "ring rollback leaves the rejected draft's keys in its slots",
            "rotated",
            "a rollback whose draft overwrote ring slots (a wrapped window)",
            CacheOp("rollback", 3),
            cache_ops=RollbackStaleRing,
            needs_window=True,
        ),
        OpFault(
            "rollback-offset",
            "rollback_offset",
            "rollback leaves the offset advanced by the draft length",
            "rotated",
            "any rollback",
            CacheOp("rollback", 3),
            rotation=RollbackOffset,
        ),
        OpFault(
            "evict-offset",
            "evict_offset",
            "eviction resets the offset to the kept-row count",
            "rotated",
            "any eviction",
            CacheOp("evict", 5),
            rotation=EvictOffset,
        ),
        OpFault(
            "shift-not-rotated",
            "shift_not_rotated",
            "shift relabels rotated keys without turning them",
            "rotated",
            "a shift of rotated keys",
            CacheOp("shift", 100),
            cache_ops=ShiftNotRotated,
            fixed_key_form=True,
        ),
        OpFault(
            "shift-rotates-raw",
            "shift_rotated_raw",
            "shift turns raw keys the reader turns again",
            "raw",
            "a shift of raw keys",
            CacheOp("shift", 100),
            cache_ops=ShiftRotatesRaw,
            fixed_key_form=True,
        ),
        OpFault(
            "shift-twice",
            "shift_applied_twice",
            "shift turns rotated keys twice",
            "rotated",
            "a shift of rotated keys",
            CacheOp("shift", 100),
            cache_ops=ShiftTwice,
            fixed_key_form=True,
        ),
        OpFault(
            "padding-offset",
            "padding_offset",
            "merged left-padded batch decoded under one shared cursor",
            "rotated",
            "a batch of different lengths",
            CacheOp("batch", 3),
            rotation=PaddingOffset,
        ),
        OpFault(
            "restore-without-positions",
            "restore_offset_lost",
            "restored cache decoded with its offset back at 0",
            "rotated",
            "any restore",
            CacheOp("restore"),
            rotation=RestoreWithoutPositions,
        ),
    )
}
