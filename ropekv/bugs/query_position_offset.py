"""query_position_offset: the query rotated at ``t + c``; the keys are right, or the newest ones off with it.

A decode step whose rotation offset left the logical position (an off-by-one, an offset taken from a
ring's fill count, a step counter reset) turns its query ``c`` positions away. The keys it and its
predecessors wrote share the error when their offsets went wrong too: the newest key sits where the
query does and later steps are never further ahead than earlier ones (a count stuck at the ring's
size gives each later step a more negative offset). The evidence gives ``c``, the keys off with it and
the older keys that are right.
"""

from __future__ import annotations

import torch

from ..engine.rotation import RotationPolicy
from ..faults.native import NativeFault
from ..parity.bug_class import BugClass
from ..parity.explain.cells import Cells, moved, query_at, query_offset, rows_of, scope_of, share, span_text
from ..parity.explain.evidence import CaseEvidence, Explanation, Match

KIND = BugClass.QUERY_POSITION_OFFSET


def explain(ev: CaseEvidence) -> Match | None:
    km, f = ev.keymap, ev.facts
    if km is None or km.rope is None:
        return None
    c = query_offset(km)
    if c is None or c == 0:
        return None
    t = f.query_position
    q_cells = query_at(km, t + c)
    k = km.keys
    off = k.offsets()[..., 0]
    shifted = moved(km)
    rows = shifted.all(1)  # every head of the key off
    j = k.positions
    k_cells = torch.zeros_like(shifted)
    note = ""
    if bool(rows.any()):
        newest = int(j.argmax())
        right_rows = km.key_exact().all(1)
        newer_than_right = not bool(right_rows.any()) or int(j[rows].min()) > int(j[right_rows].max())
        d = off[rows][:, 0]
        order = j[rows].argsort()
        steps = d[order]
        monotone = not bool((steps[1:] > steps[:-1]).any())
        if rows[newest] and int(off[newest, 0]) == c and newer_than_right and monotone:
            k_cells = shifted & rows[:, None]
            ds = sorted(set(steps.tolist()), reverse=True)
            n_off = int(rows.sum())
            if n_off == 1:
                note = " and so does the key its step wrote"
            elif len(ds) == 1:
                note = f" and so do the {n_off} newest keys"
            else:
                note = f" and the {n_off} newest keys are off too, at j {', '.join(f'{x:+d}' for x in ds[:6])} (the newest where the query is)"
    cells = Cells(k_cells, q_cells)
    right = int((km.key_exact().all(1) & ~k_cells.any(1)).sum())
    q_off = km.query.offsets()[0, :, 0]
    who = (
        "the query"
        if bool((q_off == c).all())
        else "query head " + span_text(torch.nonzero(q_off == c).flatten().tolist())
    )
    text = (
        f"keys are right but {who} sits at t {c:+d}"
        if not note
        else f"the query sits at t {c:+d} (effective {t + c}){note}"
    )
    if note:
        text += (
            f"; the {right} older keys are right: the rotation offset" if right else ": the rotation offset"
        ) + " stopped following the logical position at the steps that wrote the newest keys"
        if t + c == k.num:
            text += (
                f"; effective {t + c} = the {k.num} keys the kernel read: an offset taken from the cache's fill count "
                "(the rows a ring keeps), not from the tokens seen"
            )
    else:
        text += f" (effective {t + c}; keys {span_text(j.tolist())} at their positions)" if k.num <= 4 else ""
    shown = rows_of(k_cells) or tuple(int(i) for i in torch.nonzero(j >= t - 2).flatten().tolist())
    details = {"offset": c, "offset_keys": int(k_cells.any(1).sum())}
    return Match(KIND, share(km, cells), text, scope_of(km, cells), details, shown)


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class DecodePositionOffByOne(RotationPolicy):
    """The decode step rotates its query one position too far (query at t + 1)."""

    name = "decode-position-off-by-one"

    def query(self, rope, q, positions, ctx):
        return super().query(rope, q, positions + 1 if ctx.phase == "decode" else positions, ctx)


FAULTS = (
    NativeFault(
        name="decode-position-off-by-one",
        kind=KIND,
        description="decode query rotated at t + 1",
        key_form="rotated",
        shows_when="any decode",
        rotation=DecodePositionOffByOne,
    ),
)
