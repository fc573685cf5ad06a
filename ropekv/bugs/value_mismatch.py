"""value_mismatch: a layer's values differ from the reference's while its keys and query are right.

Values never turn, so no RoPE error shows in them; a value written from another row, scaled, or lost
changes the layer's output and the next layer's input while that layer's attention logits still
agree. The check sees it where a layer's input already differed: the layer below attended right, its
values did not. The evidence names the value rows that differ and by how much (or their scale).
"""

from __future__ import annotations

import torch

from ..faults.native import NativeFault
from ..parity.bug_class import BugClass
from ..parity.explain.cells import span_text
from ..parity.explain.evidence import CaseEvidence, Explanation, Match

KIND = BugClass.VALUE_MISMATCH


def explain(ev: CaseEvidence) -> Match | None:
    f, below = ev.facts, ev.below
    if below is None or f.input_matched is not False:
        return None
    if not bool(below.key_exact().all()) or not bool(below.query_exact().all()):
        return None
    wrong = below.values_wrong()  # [N, K]
    if not bool(wrong.any()):
        return None
    rows = wrong.any(1)
    pos = below.keys.positions[rows].tolist()
    scale = below.value_scale[wrong]
    heads = torch.nonzero(wrong.any(0)).flatten().tolist()
    how = (
        f"scaled x{float(scale.mean()):.4g}"
        if bool(((scale - scale.mean()).abs() <= 0.02 * scale.mean().abs()).all())
        and abs(float(scale.mean()) - 1) > 0.01
        else f"off by up to {float(below.values[wrong].max()):.3g} (relative)"
    )
    head_text = (
        "" if len(heads) == below.keys.heads else f" on KV head{'s' if len(heads) > 1 else ''} {span_text(heads)}"
    )
    text = (
        f"layer {below.layer}'s keys and query are right, but its values at positions {span_text(pos)}{head_text} are "
        f"{how} against the reference's values of the same rows: layer {f.layer}'s input diverged from them"
    )
    return Match(KIND, 1.0, text, "subset", {"value_layer": below.layer, "value_rows": len(pos)})


EXPLANATION = Explanation(KIND, explain)


FAULTS: tuple[NativeFault, ...] = ()  # no catalogued fault of ropekv's engine shows this class alone
