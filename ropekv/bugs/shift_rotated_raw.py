"""shift_rotated_raw: a position shift turned raw keys that the reader turns at their new positions.

A raw-key cache only relabels on a shift: the reader rotates each key at its position when it reads.
Turning raw keys by ``R(delta)`` as well puts them at ``j + delta``. The evidence names them.
"""

from __future__ import annotations

from ..cache.policy import CacheOpPolicy, turn
from ..faults.native import OpFault
from ..parity.bug_class import BugClass
from ..parity.cases import CacheOp, OpKind
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ._shift import shifted_keys

KIND = BugClass.SHIFT_ROTATED_RAW


def explain(ev: CaseEvidence) -> Match | None:
    d = ev.facts.shift
    return shifted_keys(
        ev, KIND, 1, f"raw keys were turned by R({d}) although the reader rotates them at their new positions", "raw"
    )


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class ShiftRotatesRaw(CacheOpPolicy):
    """A shift turns raw keys, which the reader turns again at their new positions."""

    name = "shift-rotates-raw"

    def shift_keys(self, rope, keys, delta, key_form):
        return turn(rope, keys, delta)


FAULTS = (
    OpFault(
        name="shift-rotates-raw",
        kind=KIND,
        description="shift turns raw keys the reader turns again",
        key_form="raw",
        shows_when="a shift of raw keys",
        op=CacheOp(OpKind.SHIFT, 100),
        cache_ops=ShiftRotatesRaw,
        fixed_key_form=True,
    ),
)
