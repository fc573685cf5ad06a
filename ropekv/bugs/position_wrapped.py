"""position_wrapped: positions narrowed to a 16- or 32-bit index; they wrap past 2**15 / 2**31.

A kernel taking its positions as int16/int32 turns position ``p`` at
``((p + 2**(b-1)) mod 2**b) - 2**(b-1)``: invisible below ``2**(b-1)``, and invisible where the query
and every key wrap alike; it shows where some wrap and others do not (keys rotated at their true
positions by a shift, a sequence straddling the limit), or where a shift's delta itself wrapped. The
evidence says which width and which tokens wrapped (tested directly at the wrapped positions, which no
integer search reaches past ``2**31``).
"""

from __future__ import annotations

import torch

from ..engine.rotation import RotationPolicy
from ..faults.native import NativeFault
from ..parity.bug_class import BugClass
from ..parity.cases import CacheOp, Case, OpKind
from ..parity.explain.cells import span_text
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..parity.explain.positions import position_match
from ..parity.keymap.fit import wrap

KIND = BugClass.POSITION_WRAPPED


def explain(ev: CaseEvidence) -> Match | None:
    km = ev.keymap
    if km is None:
        return None
    j, t = km.keys.positions, ev.facts.query_position
    found = []
    for bits in (16, 32):
        wj = wrap(j, bits)
        at_wrapped = (km.keys.effective[:, :, 0] == wj[:, None]).all(1) & km.keys.ok.all(1)
        wt = int(wrap(j.new_tensor([t]), bits)[0])
        limit = (1 << (bits - 1)) - 1

        moved = [int(p) for p in j[(wj != j) & at_wrapped].tolist()]
        kept = [int(p) for p in j[(wj == j) | ~at_wrapped].tolist()]

        def text(
            which: str, query: bool, bits: int = bits, wt: int = wt, limit: int = limit, moved=moved, kept=kept
        ) -> str:
            parts = []
            if query:
                m = (t - wt) >> bits
                power = f"2**{bits}" if m == 1 else f"{m} x 2**{bits}"
                parts.append(f"query logical {t}, effective {wt} = {t} - {power}")
            if moved:
                parts.append(
                    f"{len(moved)} key(s) ({span_text(moved)}) wrapped with it, {len(kept)} at their logical "
                    f"positions ({span_text(kept)})"
                )
            elif kept:
                parts.append(f"the {len(kept)} keys sit at their logical positions ({span_text(kept)})")
            return (
                "; ".join(parts)
                + f": positions wrapped in a {bits}-bit index (a signed int{bits} holds at most {limit})"
            )

        wrapped = int(((wj != j) & km.keys.ok.all(1) & (km.keys.effective[:, :, 0] == wj[:, None]).all(1)).sum())
        found.append(
            position_match(
                ev, KIND, keys=wj, query=wt, text=text, details={"index_bits": bits, "wrapped_keys": wrapped}
            )
        )
    return max((m for m in found if m is not None), key=lambda m: m.score, default=None)


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


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
    Case(length=20, block_size=7, decode_steps=2, op=CacheOp(OpKind.SHIFT, 40000)),
    Case(length=20, block_size=7, decode_steps=2, op=CacheOp(OpKind.SHIFT, 2**15 - 10)),
)


# A 20-token prompt shifted to 2**31 - 10: the newest keys and the first decode's query cross 2**31 - 1
# (in a raw cache the keys past it wrap on read; in a rotated one the decode's own key and query).
INT32_CASES = (Case(length=20, block_size=7, decode_steps=2, op=CacheOp(OpKind.SHIFT, 2**31 - 10)),)


FAULTS = (
    NativeFault(
        name="positions-int16",
        kind=KIND,
        description="the cached path casts the positions it rotates by to int16",
        key_form="rotated",
        shows_when="positions past 32,767 (a shift past 2**15)",
        rotation=PositionsInt16,
        exposing=INT16_CASES,
    ),
    NativeFault(
        name="positions-int32",
        kind=KIND,
        description="the cached path casts the positions it rotates by to int32",
        key_form="rotated",
        shows_when="positions past 2**31 - 1 (a shift past 2**31)",
        rotation=PositionsInt32,
        exposing=INT32_CASES,
    ),
)
