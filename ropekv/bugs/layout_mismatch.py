"""layout_mismatch: channels paired the other way (neox's ``m, m + d/2`` against gptj's ``2m, 2m + 1``).

A side that pairs the channels differently from the contract still turns each token to its position,
under the other pairing: everything of that side fits exactly there. The decode side alone (its query
and the keys it writes), the keys a chunked prefill wrote, or every token: the evidence says which.
It shows from layer 0, at any decode past position 0.
"""

from __future__ import annotations

from ..faults.native import NativeFault
from ..faults.shapes import DecodeSideSpec
from ..parity.bug_class import BugClass
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..parity.explain.positions import rotation_match

KIND = BugClass.LAYOUT_MISMATCH


def explain(ev: CaseEvidence) -> Match | None:
    km = ev.keymap
    if km is None or km.rope is None:
        return None
    contract = km.rope.layout

    def text(which: str, names: list[str], query: bool) -> str:
        who = " and ".join(x for x in ("the query" if query else "", which) if x)
        return f"contract pairs {contract} but {who} are exact rotations under {names[0]} at their positions"

    return rotation_match(ev, KIND, ("layout",), text, effective_layout="gptj" if contract == "neox" else "neox")


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class LayoutMismatch(DecodeSideSpec):
    """The decode side pairs channels the other way (neox vs gptj)."""

    name = "layout-mismatch"

    def spec(self, rope, ctx):
        return None if rope is None else rope.replace(layout="gptj" if rope.layout == "neox" else "neox")


FAULTS = (
    NativeFault(
        name="layout-mismatch",
        kind=KIND,
        description="decode side pairs channels the other way",
        key_form="rotated",
        shows_when="any decode",
        rotation=LayoutMismatch,
    ),
)
