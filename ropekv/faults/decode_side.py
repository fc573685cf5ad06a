"""The shape of a decode-side rotation fault: prefill turns with the contract's spec, the decode step
with another one (chosen per layer), for its query, its new key and, rotating on read, the keys it reads."""

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
