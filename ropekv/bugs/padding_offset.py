"""padding_offset: sequences prefilled alone, merged into a left-padded batch under one shared cursor.

Each row of a batch must rotate at its own positions. A shared cursor over left-padded rows turns a
shorter row's query (and the keys its steps write) by its padding past its position. The evidence
gives the row's offset and the paddings of the batch.
"""

from __future__ import annotations

from ..faults.native import OpFault
from ..faults.shapes import OffsetRotation
from ..parity.bug_class import BugClass
from ..parity.cases import CacheOp, Case, OpKind
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..parity.explain.positions import offset_match

KIND = BugClass.PADDING_OFFSET


def explain(ev: CaseEvidence) -> Match | None:
    f = ev.facts
    case = f.case
    if case.op is None or case.op.kind != OpKind.BATCH:
        return None
    lengths = case.batch_lengths
    pads = sorted({max(lengths) - n for n in lengths} - {0})
    found = []
    for pad in pads:
        row = next(n for n in lengths if max(lengths) - n == pad)
        found.append(
            offset_match(
                ev,
                KIND,
                pad,
                row,
                f"a shared cursor over the left-padded batch: the row's query is off by its padding (paddings {pads})",
            )
        )
    return max((m for m in found if m is not None), key=lambda m: m.score, default=None)


def shows(case: Case) -> bool:
    return case.op is not None and case.op.kind == OpKind.BATCH


EXPLANATION = Explanation(KIND, explain, shows)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class PaddingOffset(OffsetRotation):
    """A merged left-padded batch under one shared cursor: each row's query is off by its padding."""

    name = "padding-offset"

    def offset(self, ctx):
        return ctx.ops.padding


FAULTS = (
    OpFault(
        name="padding-offset",
        kind=KIND,
        description="merged left-padded batch decoded under one shared cursor",
        key_form="rotated",
        shows_when="a batch of different lengths",
        op=CacheOp(OpKind.BATCH, 3),
        rotation=PaddingOffset,
    ),
)
