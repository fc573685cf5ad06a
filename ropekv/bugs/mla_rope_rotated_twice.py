"""mla_rope_rotated_twice: multi-head latent attention's rope part rotated twice.

DeepSeek V2/V3 rotate only a trailing rope part of each key, shared by every head (``k_pe``). Turned in
the latent and again after the per-head expansion (or on write and again on read), it sits at ``2j``
while the position-free channels stay intact. The evidence names the keys whose rope part sits at
``2j`` with their other channels untouched.
"""

from __future__ import annotations

from ..engine.rotation import RotationPolicy, rotate
from ..faults.native import NativeFault
from ..parity.bug_class import BugClass
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..parity.explain.positions import position_match

KIND = BugClass.MLA_ROPE_ROTATED_TWICE


def explain(ev: CaseEvidence) -> Match | None:
    km = ev.keymap
    if km is None or km.rope is None or not ev.facts.model.has_mla or km.rope.rotary_offset == 0:
        return None
    spec = km.rope
    j, t = km.keys.positions, ev.facts.query_position
    part = f"{spec.rotary_offset}..{spec.rotary_offset + spec.rotary_dim - 1}"

    def text(which: str, query: bool) -> str:
        who = " and ".join(x for x in ("the query" if query else "", which) if x)
        return (
            f"layer {km.layer} is multi-head latent attention: its position-free channels 0..{spec.rotary_offset - 1} "
            f"are intact, but the rope part (channels {part}) of {who} was rotated twice: it sits at twice its "
            "position (the shared k_pe turned in the latent and again after expansion, or on write and again on read)"
        )

    return position_match(ev, KIND, keys=2 * j, query=2 * t, informative=j != 0, text=text, details={"layer": km.layer})


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class MlaRopeRotatedTwice(RotationPolicy):
    """Multi-head latent attention: the shared rope part ``k_pe`` is rotated when the latent row is
    written and again after the per-head expansion, so the cached keys' rope part sits at ``2j`` (their
    position-free part is untouched; the query is right)."""

    name = "mla-rope-rotated-twice"

    def write_key(self, rope, k, positions, slots, ctx):
        once = super().write_key(rope, k, positions, slots, ctx)
        return rotate(rope, once, positions, ctx) if ctx.cached and rope is not None else once


def _has_mla(cfg) -> bool:
    return cfg.mla is not None


FAULTS = (
    NativeFault(
        name="mla-rope-rotated-twice",
        kind=KIND,
        description="MLA's shared rope part rotated in the latent and again after expansion",
        key_form="rotated",
        shows_when="any decode past position 0",
        rotation=MlaRopeRotatedTwice,
        needs="multi-head latent attention (deepseek_v2, deepseek_v3)",
        applies=_has_mla,
        fixed_key_form=True,
    ),
)
