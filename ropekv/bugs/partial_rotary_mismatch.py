"""partial_rotary_mismatch: partial rotary applied to every channel; the pass-through channels turned.

phi3, glm, stablelm, nemotron and gpt_neox rotate only the first ``rotary_dim`` channels of a head; the
rest must pass through unchanged. A kernel that turns the whole head changes them (and turns the
rotary part under the whole head's frequencies). The evidence names the pass-through channels that
changed and whether the tokens fit a rotation of every channel.
"""

from __future__ import annotations

import torch

from ..faults.native import NativeFault
from ..faults.shapes import DecodeSideSpec
from ..parity.bug_class import BugClass
from ..parity.explain.cells import Cells, rows_of, scope_of, share, which_keys
from ..parity.explain.evidence import CaseEvidence, Explanation, Match

KIND = BugClass.PARTIAL_ROTARY_MISMATCH


def explain(ev: CaseEvidence) -> Match | None:
    km = ev.keymap
    if km is None or km.rope is None or km.rope.rotary_dim >= km.rope.head_dim:
        return None
    k, q = km.keys, km.query
    whole = [i for i, r in enumerate(km.rotations) if r.kind == "whole_head"]
    idx = torch.tensor(whole, dtype=torch.int64)
    k_cells = (k.passthrough > km.noise) | (k.ok & torch.isin(k.rotation, idx))
    q_cells = ((q.passthrough > km.noise) | (q.ok & torch.isin(q.rotation, idx)))[0]
    if not bool(k_cells.any()) and not bool(q_cells.any()):
        return None
    cells = Cells(k_cells, q_cells)
    spec = km.rope
    keep = (
        f"{spec.rotary_offset + spec.rotary_dim}..{spec.head_dim - 1}"
        if spec.rotary_offset == 0
        else (f"0..{spec.rotary_offset - 1}")
    )
    fits_whole = bool((k.ok & torch.isin(k.rotation, idx)).any() or (q.ok & torch.isin(q.rotation, idx)).any())
    who = " and ".join(
        x
        for x in (
            "the query" if bool(q_cells.any()) else "",
            which_keys(km, k_cells, ev.facts) if bool(k_cells.any()) else "",
        )
        if x
    )
    text = (
        f"layer {km.layer} rotates only {spec.rotary_dim} of {spec.head_dim} channels, but the pass-through "
        f"channels {keep} of {who} changed (partial rotary applied to every channel)"
        + (
            f": they fit a rotation of all {spec.head_dim} channels at the whole head's frequencies"
            if fits_whole
            else ""
        )
    )
    details = {"layer": km.layer, "rotary_dim": spec.rotary_dim}
    return Match(KIND, share(km, cells), text, scope_of(km, cells), details, rows_of(k_cells))


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class PartialRotaryAllChannels(DecodeSideSpec):
    """Partial rotary applied to every channel: the pass-through channels turn too, at frequencies
    computed for the whole head."""

    name = "partial-rotary-all-channels"

    def spec(self, rope, ctx):
        if rope is None or rope.rotary_dim == rope.head_dim:
            return rope
        return rope.replace(rotary_dim=rope.head_dim, rotary_offset=0)  # MLA: the position-free part turns too


def _has_partial(cfg) -> bool:
    return any(r is not None and r.rotary_dim < r.head_dim for r in (cfg.layer_rope(i) for i in range(cfg.num_layers)))


FAULTS = (
    NativeFault(
        name="partial-rotary-all-channels",
        kind=KIND,
        description="partial rotary applied to every channel of the head",
        key_form="rotated",
        shows_when="any decode",
        rotation=PartialRotaryAllChannels,
        needs="partial rotary (phi3, glm, stablelm, nemotron, gpt_neox)",
        applies=_has_partial,
    ),
)
