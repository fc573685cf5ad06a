"""shift_not_rotated: a position shift relabelled rotated keys without turning them.

A context shift (llama.cpp, StreamingLLM) moves a cached sequence by ``delta``; rotated keys must be
turned by ``R(delta)`` exactly once. Relabelled only, they keep their old phases: they sit at
``j - delta`` of their new positions. The evidence names the shifted keys at ``j - delta``.
"""

from __future__ import annotations

from ..cache.policy import CacheOpPolicy
from ..faults.native import OpFault
from ..parity.bug_class import BugClass
from ..parity.cases import CacheOp, OpKind
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ._shift import shifted_keys

KIND = BugClass.SHIFT_NOT_ROTATED


def explain(ev: CaseEvidence) -> Match | None:
    d = ev.facts.shift
    return shifted_keys(ev, KIND, -1, f"rotated keys were relabelled by {d:+d} but not turned by R({d})", "rotated")


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class ShiftNotRotated(CacheOpPolicy):
    """A shift relabels rotated keys without turning them."""

    name = "shift-not-rotated"

    def shift_keys(self, rope, keys, delta, key_form):
        return keys


FAULTS = (
    OpFault(
        name="shift-not-rotated",
        kind=KIND,
        description="shift relabels rotated keys without turning them",
        key_form="rotated",
        shows_when="a shift of rotated keys",
        op=CacheOp(OpKind.SHIFT, 100),
        cache_ops=ShiftNotRotated,
        fixed_key_form=True,
    ),
)
