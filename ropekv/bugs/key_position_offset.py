"""key_position_offset: the query right, keys (all or some) one constant ``c`` off their positions.

Keys written with an offset (a chunk's start counted twice, a prefix length added, an index base off
by one) sit at ``j + c`` while the query is right. The evidence gives ``c`` and which keys (the rows,
heads or phase that wrote them); a constant that accounts for only a few of the wrong keys is not this
class (the rest is said by the key map's description instead).
"""

from __future__ import annotations

import torch

from ..faults.native import NativeFault
from ..parity.bug_class import BugClass
from ..parity.explain.cells import Cells, moved, right_elsewhere, rows_of, scope_of, share, which_keys
from ..parity.explain.evidence import CaseEvidence, Explanation, Match

KIND = BugClass.KEY_POSITION_OFFSET


def explain(ev: CaseEvidence) -> Match | None:
    km = ev.keymap
    if km is None or km.rope is None or not bool(km.query_exact().all()):
        return None
    cells_k = moved(km)
    if not bool(cells_k.any()):
        return None
    off = km.keys.offsets()[..., 0]
    vals, counts = torch.unique(off[cells_k], return_counts=True)
    c = int(vals[counts.argmax()])
    # keys whose j + c would be negative sit at 0 (a position clamped, or an index that cannot go below)
    j = km.keys.positions[:, None].expand_as(off)
    at_c = cells_k & ((off == c) | ((c < 0) & (j + c <= 0) & (j + off == 0)))
    cells = Cells(at_c, torch.zeros(km.query.heads, dtype=torch.bool))
    text = f"{which_keys(km, at_c, ev.facts)} sit at j {c:+d} while the query is right" + right_elsewhere(km, at_c)
    return Match(KIND, share(km, cells), text, scope_of(km, cells), {"offset": c}, rows_of(at_c))


EXPLANATION = Explanation(KIND, explain)


FAULTS: tuple[NativeFault, ...] = ()  # no catalogued fault of ropekv's engine shows this class alone
