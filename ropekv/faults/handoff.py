"""The record of a fault of the prefill->decode handoff: what the decode side wrongly does to imported keys.

Each is an :class:`~ropekv.cache.import_policy.ImportPolicy` subclass handed to the import
(``ropekv handoff --inject NAME``, ``HandoffAdapter(policy=...)``); the importer has no fault switches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..cache.import_policy import ImportPolicy
from .record import Fault, FaultEngine


@dataclass(frozen=True, kw_only=True)
class HandoffFault(Fault):
    """A :class:`~ropekv.faults.record.Fault` of the handoff; ``policy`` builds the import policy."""

    engine: FaultEngine = field(default="handoff", init=False)
    policy: Callable[[], ImportPolicy]
