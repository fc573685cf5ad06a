"""The shapes several faults share: a decode side that turns with another spec, and a cached path
whose rotation offset left the logical positions. Each catalogued fault that has one of these shapes
subclasses it and overrides one method (its bug module under :mod:`ropekv.bugs` holds it)."""

from __future__ import annotations

from ..engine.rotation import RotationPolicy
from ..rope import RopeSpec


class DecodeSideSpec(RotationPolicy):
    """The decode step turns its query, its new key and (rotating on read) the keys it reads with
    :meth:`spec` of the layer's contract spec; prefill and the cache-free forward keep the contract's."""

    def spec(self, rope: RopeSpec | None, ctx) -> RopeSpec | None:
        raise NotImplementedError

    def _pick(self, rope, ctx):
        return self.spec(rope, ctx) if ctx.phase == "decode" else rope

    def query(self, rope, q, positions, ctx):
        return super().query(self._pick(rope, ctx), q, positions, ctx)

    def write_key(self, rope, k, positions, slots, ctx):
        return super().write_key(self._pick(rope, ctx), k, positions, slots, ctx)

    def read_keys(self, rope, stored, rotation_index, slots, ctx, *, backend_rotates):
        return super().read_keys(
            self._pick(rope, ctx), stored, rotation_index, slots, ctx, backend_rotates=backend_rotates
        )


class OffsetRotation(RotationPolicy):
    """Queries and new keys turn at ``position + offset(ctx)`` on the cached path."""

    def offset(self, ctx) -> int:
        raise NotImplementedError

    def query(self, rope, q, positions, ctx):
        return super().query(rope, q, positions + self.offset(ctx) if ctx.cached else positions, ctx)

    def write_key(self, rope, k, positions, slots, ctx):
        moved = positions + self.offset(ctx) if ctx.cached else positions
        return super().write_key(rope, k, moved, slots, ctx)
