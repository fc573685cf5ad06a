"""nope_rotated: a layer without position embedding (NoPE) had its query or keys turned.

cohere2, smollm3 and llama4 interleave NoPE layers; their queries and keys must reach the kernel as
projected. A kernel that rotates every layer turns them (usually under the other layers' RoPE). The
evidence names the layer and the spec its tokens fit.
"""

from __future__ import annotations

import torch

from ..faults.native import NativeFault
from ..faults.shapes import DecodeSideSpec
from ..parity.bug_class import BugClass
from ..parity.explain.cells import Cells, scope_of, share, which_keys
from ..parity.explain.evidence import CaseEvidence, Explanation, Match

KIND = BugClass.NOPE_ROTATED


def explain(ev: CaseEvidence) -> Match | None:
    km = ev.keymap
    if km is None or km.rope is not None:
        return None
    k, q = km.keys, km.query
    turned_k = k.ok & (k.rotation != 0)
    turned_q = (q.ok & (q.rotation != 0))[0]
    wrong_k, wrong_q = km.wrong_keys(), km.wrong_query()
    if not bool(turned_k.any()) and not bool(turned_q.any()):
        # not a rotation the fit knows, but the layer's tokens changed all the same
        turned_k, turned_q = wrong_k, wrong_q
        if not bool(turned_k.any()) and not bool(turned_q.any()):
            return None
        cells = Cells(turned_k, turned_q)
        return Match(
            KIND,
            share(km, cells),
            f"layer {km.layer} has no position embedding (NoPE), but the kernel's query or keys differ from the raw "
            "ones: they were turned",
            scope_of(km, cells),
            {"layer": km.layer},
        )
    used = torch.unique(torch.cat((k.rotation[turned_k], q.rotation[0][turned_q]))).tolist()
    names = ", ".join(km.rotations[int(i)].name for i in used)
    who = " and ".join(
        x
        for x in (
            "its query" if bool(turned_q.any()) else "",
            which_keys(km, turned_k, ev.facts) if bool(turned_k.any()) else "",
        )
        if x
    )
    cells = Cells(turned_k, turned_q)
    return Match(
        KIND,
        share(km, cells),
        f"layer {km.layer} has no position embedding (NoPE), but {who} are rotations under {names}",
        scope_of(km, cells),
        {"layer": km.layer},
    )


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class NopeLayerRotated(DecodeSideSpec):
    """A layer without position embedding (NoPE) turns its queries and keys with the model's RoPE."""

    name = "nope-layer-rotated"

    def spec(self, rope, ctx):
        return next((r for r in ctx.layer_ropes if r is not None), None) if rope is None else rope


def _has_nope(cfg) -> bool:
    return any(cfg.layer_rope(i) is None for i in range(cfg.num_layers))


FAULTS = (
    NativeFault(
        name="nope-layer-rotated",
        kind=KIND,
        description="a NoPE layer turns its queries and keys",
        key_form="rotated",
        shows_when="any decode past position 0",
        rotation=NopeLayerRotated,
        needs="NoPE layers (cohere2, smollm3, exaone4)",
        applies=_has_nope,
    ),
)
