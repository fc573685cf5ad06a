"""prefill_rows_diverged: rows the prefill wrote hold other contents from this layer on, while the
decode path is right.

A prefill-only bug below this layer (a chunk's queries rotated relative to the chunk, a chunk's mask,
a prefill kernel reading the wrong rows) computes wrong attention for the rows it prefills; their
next layer's keys and values then come from other hidden states. The decode step itself is right: its
query and the keys it wrote fit, and every layer below matched for it. What the decode sees is those
prefill rows holding keys that are no rotation of their own tokens' keys. The evidence names the
phase (the prefill, chunks k..n) whose rows hold them.
"""

from __future__ import annotations

import torch

from ..faults.native import NativeFault
from ..parity.bug_class import BugClass
from ..parity.explain.cells import Cells, rows_of, scope_of, share, which_keys
from ..parity.explain.evidence import CaseEvidence, Explanation, Match

KIND = BugClass.PREFILL_ROWS_DIVERGED


def explain(ev: CaseEvidence) -> Match | None:
    km, f = ev.keymap, ev.facts
    if km is None or km.layer == 0 or not bool(km.query_exact().all()):
        return None
    k = km.keys
    other = km.wrong_keys() & (~k.ok | (k.placed() & (k.residual > km.noise)))
    if not bool(other.any()):
        return None
    rows = other.any(1)
    prompt = (k.positions < f.prompt_end) & (k.positions >= f.shift)
    if bool((rows & ~prompt).any()):
        return None  # rows the decode steps wrote are wrong too: not a prefill-only bug
    cells = Cells(other, torch.zeros(km.query.heads, dtype=torch.bool))
    text = (
        f"{which_keys(km, other, ev.facts)} hold keys that are no rotation of their own tokens' keys at layer "
        f"{km.layer} (fit {float(k.fit[other].min()):.2f} at worst) while the query and the keys the decode steps "
        f"wrote are right and every layer below matched: the prefill computed those rows' layer-{km.layer} inputs "
        "wrong (a prefill-only bug below this layer: a chunk's query positions, a chunk's mask)"
    )
    return Match(
        KIND, share(km, cells), text, scope_of(km, cells, prompt[:, None].expand_as(other)), {}, rows_of(other)
    )


EXPLANATION = Explanation(KIND, explain)


FAULTS: tuple[NativeFault, ...] = ()  # no catalogued fault of ropekv's engine shows this class alone
