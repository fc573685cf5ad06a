"""Faults of the prefill->decode handoff: what the decode side wrongly does to imported keys.

Each is an :class:`~ropekv.cache.import_policy.ImportPolicy` subclass handed to the import
(``ropekv handoff --inject NAME``, ``HandoffAdapter(policy=...)``); the importer has no fault switches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..cache.import_policy import ImportPolicy
from ..rope import RopeSpec
from .record import Fault, FaultEngine


class RotateOnTransfer(ImportPolicy):
    """Fault: the decode side rotates imported keys once more ("rotate everything for consistency").

    Whatever the key form, the handed-off keys then sit at ``2j`` when read; keys decoded later at ``j``.
    """

    name = "rotate-on-transfer"

    def imported_keys(self, rope: RopeSpec, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return rope.rotate(keys, positions)


@dataclass(frozen=True, kw_only=True)
class HandoffFault(Fault):
    """A :class:`~ropekv.faults.record.Fault` of the handoff; ``policy`` builds the import policy."""

    engine: FaultEngine = field(default="handoff", init=False)
    policy: Callable[[], ImportPolicy]


CATALOGUE: tuple[HandoffFault, ...] = (
    HandoffFault(
        name="rotate-on-transfer",
        kind="rotate_on_transfer",
        description="the decode side rotates imported keys once more",
        policy=RotateOnTransfer,
    ),
)
