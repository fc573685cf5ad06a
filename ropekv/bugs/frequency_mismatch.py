"""frequency_mismatch: tokens turned at their positions under other frequencies than the contract's.

Still rotations (every pair keeps its length) but not at integer multiples of the contract's
frequencies: a theta read from another config field, a scaling factor lost or added, another model's
spec. The fit estimates the frequencies those tokens turned under, from all of them at once, as one
theta (base) or one factor on every frequency, exact to far better than 1% when the fit is close to
1. The evidence gives the estimate and which tokens carry it (the decode side only, some rows).
"""

from __future__ import annotations

from ..faults.native import NativeFault
from ..faults.shapes import DecodeSideSpec
from ..parity.bug_class import BugClass
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..parity.explain.positions import rotation_match

KIND = BugClass.FREQUENCY_MISMATCH


def explain(ev: CaseEvidence) -> Match | None:
    def text(which: str, names: list[str], query: bool) -> str:
        who = " and ".join(x for x in ("the query" if query else "", which) if x)
        return (
            f"still rotations (pair lengths kept) but not at the contract's frequencies: {who} turn at their "
            f"positions under {names[0]}"
        )

    return rotation_match(ev, KIND, ("estimated",), text)


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class ScalingMismatch(DecodeSideSpec):
    """The decode side uses theta x 4 (a config read with another base or scaling)."""

    name = "scaling-mismatch"

    def spec(self, rope, ctx):
        return None if rope is None else rope.replace(theta=rope.theta * 4)


FAULTS = (
    NativeFault(
        name="scaling-mismatch",
        kind=KIND,
        description="decode side uses theta x 4",
        key_form="rotated",
        shows_when="any decode",
        rotation=ScalingMismatch,
    ),
)
