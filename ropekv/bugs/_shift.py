"""What the three shift bugs share: the shifted keys sit at ``j + c delta`` for one ``c``."""

from __future__ import annotations

from ..parity.bug_class import BugClass
from ..parity.cases import OpKind
from ..parity.explain.evidence import CaseEvidence, Match
from ..parity.explain.positions import position_match


def shifted_keys(ev: CaseEvidence, kind: BugClass, times: int, why: str, key_form: str | None) -> Match | None:
    """``kind`` where the keys the shift moved sit at ``j + times * delta`` while the query is right
    (``key_form``: the cache's key form this bug needs, None: either)."""
    km, f = ev.keymap, ev.facts
    case = f.case
    if km is None or case.op is None or case.op.kind != OpKind.SHIFT:
        return None
    if key_form is not None and f.key_form is not None and f.key_form != key_form:
        return None
    d = case.op.amount
    j = km.keys.positions
    moved = (j >= d) & (j < d + case.prefix + case.length)
    off = times * d
    return position_match(
        ev,
        kind,
        keys=j + off,
        informative=moved,
        text=lambda which, q: f"{which} sit at j {off:+d}: {why}",
        details={"offset": off},
    )
