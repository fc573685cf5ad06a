"""Faults of position index width: the positions the engine rotates by held in too narrow an integer.

A kernel that takes its positions as int32 or int16 while the engine's positions are int64 wraps them
modulo ``2**bits`` (two's complement: 40,020 in 16 bits is -25,516) without a word. The wrap is
invisible while every position is below ``2**(bits - 1)``, and invisible again where the query and
every key it reads wrap alike (the scores depend on ``i - j`` only): it shows where the cached keys
were rotated at their true positions (a rotated cache whose keys a shift turned exactly) while the
query wraps, or where the query and the newest keys sit past ``2**(bits - 1)`` and older keys below.

Only the cached path narrows (the engine's own cache-free forward keeps int64), so self-parity sees
it as well as the float64 reference. The exposing cases reach past ``2**15`` through ``shift``; a
shift past ``2**31`` is beyond what a parity case holds (its attention rows are kept by position, see
:class:`~ropekv.parity.cases.CacheOp`), so :class:`PositionsInt32` is not catalogued: the tests run it on
the engine directly (tests/test_position_width.py).
"""

from __future__ import annotations

import torch

from ..engine.rotation import RotationPolicy
from ..parity.cases import CacheOp, Case
from .native import NativeFault


def wrap_positions(positions: torch.Tensor, bits: int) -> torch.Tensor:
    """``positions`` as a signed ``bits``-bit index holds them, back in int64 (what a narrowing cast
    hands a kernel): ``((p + 2**(bits - 1)) mod 2**bits) - 2**(bits - 1)``."""
    dtype = {16: torch.int16, 32: torch.int32}[bits]
    return positions.to(dtype).to(torch.int64)


class _NarrowPositions(RotationPolicy):
    """The cached path casts the positions it rotates queries and keys by to ``bits`` bits."""

    bits = 64

    def _narrow(self, positions: torch.Tensor, ctx) -> torch.Tensor:
        return wrap_positions(positions, self.bits) if ctx.cached else positions

    def query(self, rope, q, positions, ctx):
        return super().query(rope, q, self._narrow(positions, ctx), ctx)

    def write_key(self, rope, k, positions, slots, ctx):
        return super().write_key(rope, k, self._narrow(positions, ctx), slots, ctx)

    def read_keys(self, rope, stored, rotation_index, slots, ctx, *, backend_rotates):
        index = self._narrow(rotation_index, ctx)
        return super().read_keys(rope, stored, index, slots, ctx, backend_rotates=backend_rotates)


class PositionsInt16(_NarrowPositions):
    """Positions cast to int16 on the cached path: they wrap past 32,767."""

    name = "positions-int16"
    bits = 16


class PositionsInt32(_NarrowPositions):
    """Positions cast to int32 on the cached path: they wrap past 2**31 - 1."""

    name = "positions-int32"
    bits = 32


# A 20-token prompt shifted by 40,000 (every position past 2**15: a rotated cache's keys, turned exactly
# by the shift, stay right while the query wraps) and by 32,758 (the sequence straddles 32,767: the
# newest keys and the query wrap, the older keys do not, in either key form).
INT16_CASES = (
    Case(length=20, block_size=7, decode_steps=2, op=CacheOp("shift", 40000)),
    Case(length=20, block_size=7, decode_steps=2, op=CacheOp("shift", 2**15 - 10)),
)

CATALOGUE: tuple[NativeFault, ...] = (
    NativeFault(
        name="positions-int16",
        kind="position_wrapped",
        description="the cached path casts the positions it rotates by to int16",
        key_form="rotated",
        shows_when="positions past 32,767 (a shift past 2**15)",
        rotation=PositionsInt16,
        exposing=INT16_CASES,
    ),
)
