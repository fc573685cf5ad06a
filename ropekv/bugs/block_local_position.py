"""block_local_position: keys rotated by where they sit in their cache block, not by their position.

Keys at ``j mod B`` (their index inside their block) or at ``B floor(j / B)`` (their block's first
position: a block's start taken as every row's position, as when a partial block's rows are written
with the block's offset): both equal the position inside the first block (and the second at the
block's first row), so only keys past it show the bug. The evidence names which form, and the keys.
"""

from __future__ import annotations

from ..engine.rotation import RotationPolicy
from ..faults.native import NativeFault
from ..parity.bug_class import BugClass
from ..parity.cases import Case
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..parity.explain.positions import position_match

KIND = BugClass.BLOCK_LOCAL_POSITION


def explain(ev: CaseEvidence) -> Match | None:
    km, f = ev.keymap, ev.facts
    b = f.block_size
    if km is None or b <= 1:
        return None
    j, t = km.keys.positions, f.query_position
    local = position_match(
        ev,
        KIND,
        keys=j % b,
        query=t % b,
        informative=j >= b,
        text=lambda which, q: (
            (f"{which} sit at their index inside their block (j mod {b})" if which else "")
            + (f"{'; ' if which else ''}the query sits at t mod {b} = {t % b}" if q else "")
        ),
        details={"form": "j mod B"},
    )
    start = position_match(
        ev,
        KIND,
        keys=j - j % b,
        query=t - t % b,
        informative=j % b != 0,
        text=lambda which, q: (
            (f"{which} sit at their block's first position (B floor(j / B), B = {b})" if which else "")
            + (f"{'; ' if which else ''}the query sits at its block's start {t - t % b}" if q else "")
        ),
        details={"form": "block start"},
    )
    # The keys are written at the same wrong index as the query: a query alone at its block's start is
    # a constant query offset that happens to land there (query_position_offset says it), not this class.
    found = [m for m in (local, start) if m is not None and m.shown]
    return max(found, key=lambda m: m.score, default=None)


def shows(case: Case) -> bool:
    return case.prefix + case.length > case.block_size


EXPLANATION = Explanation(KIND, explain, shows)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class BlockLocalPosition(RotationPolicy):
    """Keys are rotated by their offset inside their cache block (key at j mod B)."""

    name = "block-local-position"

    def write_key(self, rope, k, positions, slots, ctx):
        local = positions % ctx.block_size if ctx.cached else positions
        return super().write_key(rope, k, local, slots, ctx)


FAULTS = (
    NativeFault(
        name="block-local-position",
        kind=KIND,
        description="keys rotated by their offset inside the block",
        key_form="rotated",
        shows_when="a context longer than one block",
        rotation=BlockLocalPosition,
    ),
)
