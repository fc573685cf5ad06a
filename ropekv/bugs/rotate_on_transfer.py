"""rotate_on_transfer: a prefill->decode handoff rotated already rotated keys once more.

The handed-off tokens (positions below the handoff length ``H``) sit at ``2j`` on the decode side,
the keys decoded after the handoff at ``j``: a "rotate everything for consistency" at the import.
It shows only across a handoff. The evidence names the handed-off keys at ``2j``.
"""

from __future__ import annotations

import torch

from ..cache.import_policy import ImportPolicy
from ..faults.handoff import HandoffFault
from ..parity.bug_class import BugClass
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..parity.explain.positions import position_match
from ..rope import RopeSpec

KIND = BugClass.ROTATE_ON_TRANSFER


def explain(ev: CaseEvidence) -> Match | None:
    km, f = ev.keymap, ev.facts
    if km is None or f.handoff_len <= 0:
        return None
    j, h = km.keys.positions, f.handoff_len
    return position_match(
        ev,
        KIND,
        keys=2 * j,
        informative=(j > 0) & (j < h),
        text=lambda which, q: (
            f"{which} (the {h} handed-off tokens) sit at 2j, later keys at j: the handoff "
            "rotated already rotated keys once more"
        ),
    )


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


class RotateOnTransfer(ImportPolicy):
    """Fault: the decode side rotates imported keys once more ("rotate everything for consistency").

    Whatever the key form, the handed-off keys then sit at ``2j`` when read; keys decoded later at ``j``.
    """

    name = "rotate-on-transfer"

    def imported_keys(self, rope: RopeSpec, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return rope.rotate(keys, positions)


FAULTS = (
    HandoffFault(
        name="rotate-on-transfer",
        kind=KIND,
        description="the decode side rotates imported keys once more",
        policy=RotateOnTransfer,
    ),
)
