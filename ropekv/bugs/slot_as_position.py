"""slot_as_position: keys (or the query) rotated by their physical slot, not their logical position.

A ring buffer's slot (``sinks + (j - sinks) mod W`` past the sinks) or a paged cache's slot index
used as the rotation index: identical to the position until the window wraps (or the block table
leaves the identity), then the keys sit at their slots. A decode step that takes its ring slot as its
own rotation index puts the query (and the key it writes) there too. The evidence names the keys at
their slots, and the query where it sits at its own ring index.
"""

from __future__ import annotations

import torch

from ..engine.rotation import RotationPolicy
from ..faults.native import NativeFault
from ..parity.bug_class import BugClass
from ..parity.cases import Case
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..parity.explain.positions import position_match

KIND = BugClass.SLOT_AS_POSITION


def ring_index(p: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """The slot of position ``p`` in a ring of ``window`` slots after ``sinks`` kept ones."""
    return torch.where(p < sinks, p, sinks + (p - sinks) % window)


def explain(ev: CaseEvidence) -> Match | None:
    km, f = ev.keymap, ev.facts
    if km is None:
        return None
    j, t = km.keys.positions, f.query_position
    found = []
    slots = km.slots
    if bool((slots >= 0).any()):
        engine_slots = torch.where(slots >= 0, slots, j)

        def by_slot(which: str, query: bool) -> str:
            return f"{which} sit at their physical slot instead of their logical position"

        found.append(position_match(ev, KIND, keys=engine_slots, text=by_slot, details={"slot_source": "engine"}))
    if f.window is not None:
        ring = ring_index(j, f.window, f.sinks)
        q_ring = int(ring_index(torch.tensor([t]), f.window, f.sinks)[0])

        def by_ring(which: str, query: bool) -> str:
            ring_of = (
                f"their ring slot (sinks {f.sinks} + (j - {f.sinks}) mod {f.window})"
                if f.sinks
                else (f"their ring slot (j mod {f.window})")
            )
            parts = [f"{which} sit at {ring_of}"] if which else []
            if query:
                parts.append(
                    f"the query sits at its own ring slot {q_ring} (position {t}): the ring index used as the rotation index"
                )
            return "; ".join(parts)

        found.append(position_match(ev, KIND, keys=ring, query=q_ring, text=by_ring, details={"slot_source": "ring"}))
    return max((m for m in found if m is not None), key=lambda m: m.score, default=None)


def shows(case: Case) -> bool:
    return case.window_wrapped


EXPLANATION = Explanation(KIND, explain, shows)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class SlotAsPosition(RotationPolicy):
    """Rotate-on-read takes the ring slot as the rotation index (key at its slot once the window wraps)."""

    name = "slot-as-position"

    def read_keys(self, rope, stored, rotation_index, slots, ctx, *, backend_rotates):
        index = slots if ctx.cached else rotation_index
        return super().read_keys(rope, stored, index, slots, ctx, backend_rotates=backend_rotates)


FAULTS = (
    NativeFault(
        name="slot-as-position",
        kind=KIND,
        description="ring slot used as rotation index",
        key_form="raw",
        shows_when="a sliding window that has wrapped",
        rotation=SlotAsPosition,
    ),
)
