"""shift_applied_twice: a position shift turned rotated keys by ``R(delta)`` twice for one relabelling.

The re-rotation ran twice (a K-shift graph applied on two decodes, a shift queued twice) while the
positions moved once: the shifted keys sit at ``j + delta``. The evidence names them.
"""

from __future__ import annotations

from ..cache.policy import CacheOpPolicy, turn
from ..faults.native import OpFault
from ..parity.bug_class import BugClass
from ..parity.cases import CacheOp, OpKind
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ._shift import shifted_keys

KIND = BugClass.SHIFT_APPLIED_TWICE


def explain(ev: CaseEvidence) -> Match | None:
    d = ev.facts.shift
    return shifted_keys(ev, KIND, 1, f"rotated keys were turned by R({d}) twice for one relabelling", "rotated")


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class ShiftTwice(CacheOpPolicy):
    """A shift's re-rotation runs twice (turned by R(2 delta)) while positions move once."""

    name = "shift-twice"

    def shift_keys(self, rope, keys, delta, key_form):
        return turn(rope, keys, 2 * delta) if key_form == "rotated" else keys


FAULTS = (
    OpFault(
        name="shift-twice",
        kind=KIND,
        description="shift turns rotated keys twice",
        key_form="rotated",
        shows_when="a shift of rotated keys",
        op=CacheOp(OpKind.SHIFT, 100),
        cache_ops=ShiftTwice,
        fixed_key_form=True,
    ),
)
