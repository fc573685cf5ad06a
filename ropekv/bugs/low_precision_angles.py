"""low_precision_angles: rotation angles computed in bfloat16 or float16.

``position x inv_freq`` in a 16-bit format loses ``p w 2^-9`` rad (bf16), and past 256 (bf16) or 2048
(fp16) the position itself rounds (513 turns as 512): an error that grows with position. Both paths of
one engine share the table, so the engine agrees with itself and only the float64 reference sees it.
The fit tries the three forms engines use: angles computed that way in the 16-bit format, exact
angles rounded to it, and cos/sin tables stored in it; the evidence names the form, the format and the
tokens that match it, with an example of a rounded position where one is in view.
"""

from __future__ import annotations

import torch

from ..engine.rotation import RotationPolicy
from ..faults.native import NativeFault
from ..parity.bug_class import BugClass
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..parity.explain.positions import rotation_match
from ..rope import RopeSpec, apply_rotation

KIND = BugClass.LOW_PRECISION_ANGLES


def explain(ev: CaseEvidence) -> Match | None:
    t = ev.facts.query_position

    def text(which: str, names: list[str], query: bool) -> str:
        who = " and ".join(x for x in ("the query" if query else "", which) if x)
        fmt = names[0].rsplit(" ", 1)[-1]
        dt = torch.bfloat16 if fmt == "bfloat16" else torch.float16
        rounded = int(torch.tensor([t]).to(dt).long()[0])
        example = f" ({t} -> {rounded})" if rounded != t else ""
        limit = 256 if fmt == "bfloat16" else 2048
        if names[0].startswith("angles rounded"):
            how = f"angles position x inv_freq rounded to {fmt}, an error that grows with position"
        elif names[0].startswith("cos/sin"):
            how = f"cos/sin tables stored in {fmt}: each turn off by {fmt}'s rounding of cos and sin"
        else:
            how = (
                f"angles computed as position x inv_freq in {fmt}{example} (which holds integers exactly only "
                f"up to {limit}), an error that grows with position"
            )
        return f"{who} match {names[0]}: {how}" + (
            " (the engine agrees with itself: both of its paths share the table)" if ev.facts.self_passed else ""
        )

    return rotation_match(ev, KIND, ("precision",), text)


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


def _bf16_rotate(rope: RopeSpec | None, x: torch.Tensor, positions: torch.Tensor, seq_len: int) -> torch.Tensor:
    if rope is None:  # a NoPE layer
        return x
    ang = (positions.to(torch.bfloat16)[:, None] * rope.inv_freq(seq_len).to(torch.bfloat16)[None, :]).double()
    return apply_rotation(
        x,
        torch.cos(ang) * rope.attention_factor,
        torch.sin(ang) * rope.attention_factor,
        rope.layout,
        rope.rotary_offset,
    )


class LowPrecisionAngles(RotationPolicy):
    """Angles computed in bfloat16 everywhere (both engine paths agree; only float64 catches it)."""

    name = "low-precision-angles"

    def query(self, rope, q, positions, ctx):
        return _bf16_rotate(rope, q, positions, ctx.seq_len)

    def write_key(self, rope, k, positions, slots, ctx):
        return _bf16_rotate(rope, k, positions, ctx.seq_len)

    def read_keys(self, rope, stored, rotation_index, slots, ctx, *, backend_rotates):
        if backend_rotates:
            return _bf16_rotate(rope, stored.float(), rotation_index, ctx.seq_len)
        return stored


FAULTS = (
    NativeFault(
        name="low-precision-angles",
        kind=KIND,
        description="rotation angles computed in bfloat16 in every path",
        key_form="rotated",
        shows_when="positions past a few hundred; only the float64 reference sees it",
        rotation=LowPrecisionAngles,
    ),
)
