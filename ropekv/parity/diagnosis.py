"""The diagnosis record: a bug class, the sentence that shows it, and its numbers.

Every producer returns one :class:`Diagnosis`: the general forensics
(:func:`ropekv.parity.forensics.diagnose`), the per-layer RoPE features
(:func:`ropekv.parity.layer_forensics.diagnose_layer`) and the assembly at a case's first divergent
layer (:mod:`ropekv.parity.layer_diagnosis`), whose result the report prints and writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import UsageError
from .bug_class import BugClass


@dataclass(frozen=True)
class Diagnosis:
    """The bug class and what shows it.

    ``evidence`` is the sentence the report prints ("logical 37, slot 5, effective 74; ...; query
    logical 40, effective 40"); ``details`` holds json-able numbers and names. Where the general
    forensics estimated positions, ``query_effective`` is the query's effective position (None where
    no integer fits), ``key_effective`` one entry per key (the effective position under the winning
    explanation, None where nothing fits) and ``fit`` the |r||c|-weighted mean fit in [0, 1]; the other
    producers (masks, per-layer features) estimate none and leave them empty. Only ``kind``,
    ``evidence`` and ``details`` are written to the report (:meth:`to_dict`).
    """

    kind: BugClass
    evidence: str
    details: dict[str, Any] = field(default_factory=dict)
    query_effective: int | None = None
    key_effective: tuple[int | None, ...] = ()  # [N]
    fit: float | None = None  # in [0, 1]

    def __post_init__(self) -> None:
        if not isinstance(self.kind, BugClass):
            raise UsageError(f"Diagnosis.kind must be a BugClass, got {self.kind!r}")
        if not isinstance(self.evidence, str):
            raise UsageError(f"Diagnosis.evidence must be a string, got {self.evidence!r}")
        if self.fit is not None and not 0.0 <= self.fit <= 1.0:
            raise UsageError(f"Diagnosis.fit must be in [0, 1], got {self.fit!r}")

    def to_dict(self) -> dict[str, Any]:
        """The report's JSON ``"diagnosis"`` object."""
        return {"kind": self.kind.value, "evidence": self.evidence, "details": self.details}
