"""rollback_offset: after a rollback (speculative decoding rejected a draft) the offset still counts it.

A rollback must give back exactly the rejected tokens and leave the offset at the accepted length; an
engine that moves the keys back but keeps the offset turns every later query and key the draft's
length past its position (mlx-vlm #1155; a spec step's target or drafter alike). The evidence gives
the query's offset and the keys the later steps wrote at it.
"""

from __future__ import annotations

from ..faults.native import OpFault
from ..faults.shapes import OffsetRotation
from ..parity.bug_class import BugClass
from ..parity.cases import CacheOp, Case, OpKind
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..parity.explain.positions import offset_match

KIND = BugClass.ROLLBACK_OFFSET


def explain(ev: CaseEvidence) -> Match | None:
    f = ev.facts
    case = f.case
    if case.op is None:
        return None
    if case.op.kind == OpKind.ROLLBACK:
        n = case.op.amount
        return offset_match(
            ev,
            KIND,
            n,
            f.prompt_end,
            f"the offset kept the rejected {n}-token draft (advanced by the draft length, not the accepted count)",
        )
    if case.op.kind == OpKind.SPEC and f.role in ("decode", "redraft"):
        k, m = case.op.amount, case.spec_accepted
        rejected = k - m if f.role == "decode" else k - 1 - m
        who = "the target's" if f.role == "decode" else "the drafter's"
        return offset_match(
            ev,
            KIND,
            rejected,
            f.prompt_end + m,
            f"{who} offset kept the {rejected} rejected token(s) of the verify pass of the {k}-token draft "
            f"({m} accepted)",
        )
    return None


def shows(case: Case) -> bool:
    return case.op is not None and case.op.kind in (OpKind.ROLLBACK, OpKind.SPEC)


EXPLANATION = Explanation(KIND, explain, shows)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class RollbackOffset(OffsetRotation):
    """After a rollback the offset still counts the rejected draft (mlx-vlm #1155)."""

    name = "rollback-offset"

    def offset(self, ctx):
        return ctx.ops.rolled_back


FAULTS = (
    OpFault(
        name="rollback-offset",
        kind=KIND,
        description="rollback leaves the offset advanced by the draft length",
        key_form="rotated",
        shows_when="any rollback",
        op=CacheOp(OpKind.ROLLBACK, 3),
        rotation=RollbackOffset,
    ),
)
