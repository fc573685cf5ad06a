"""restore_offset_lost: a restored cache decoded with its offset back at 0.

Save/restore must bring back keys, values, positions and the contract together. Keys restored with
the offset left at 0 turn the next token (and every later one) as if nothing were cached: at
``t - n`` for ``n`` restored tokens. The evidence gives that offset.
"""

from __future__ import annotations

from ..faults.native import OpFault
from ..faults.shapes import OffsetRotation
from ..parity.bug_class import BugClass
from ..parity.cases import CacheOp, Case, OpKind
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..parity.explain.positions import offset_match

KIND = BugClass.RESTORE_OFFSET_LOST


def explain(ev: CaseEvidence) -> Match | None:
    f = ev.facts
    case = f.case
    if case.op is None or case.op.kind != OpKind.RESTORE:
        return None
    n = case.prefix + case.length
    return offset_match(
        ev,
        KIND,
        -n,
        f.prompt_end,
        f"the restored sequence's offset restarted at 0 (its {n} positions were not restored with the keys)",
    )


def shows(case: Case) -> bool:
    return case.op is not None and case.op.kind == OpKind.RESTORE


EXPLANATION = Explanation(KIND, explain, shows)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class RestoreWithoutPositions(OffsetRotation):
    """A restored cache whose offset restarts at 0: the next token turns as if nothing was cached."""

    name = "restore-without-positions"

    def offset(self, ctx):
        return -ctx.ops.restored


FAULTS = (
    OpFault(
        name="restore-without-positions",
        kind=KIND,
        description="restored cache decoded with its offset back at 0",
        key_form="rotated",
        shows_when="any restore",
        op=CacheOp(OpKind.RESTORE),
        rotation=RestoreWithoutPositions,
    ),
)
