"""The diagnosis record: a bug class, the sentence that shows it, its numbers, and the key map it read.

One :class:`Diagnosis` per check, assembled across every failing case by
:func:`ropekv.parity.explain.combine.diagnose_cases` from the plug-in explanations; the report prints
its sentence and, where the forensics tier fitted one, the key map of the case it was named from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import UsageError
from .bug_class import BugClass
from .keymap.record import KeyMap


@dataclass(frozen=True, eq=False)
class Diagnosis:
    """The bug class and what shows it.

    ``evidence`` is the sentence the report prints; ``details`` holds json-able numbers and names
    (the case it was named from, the layer, the query position, the cases that support it and those
    that named another class); ``keymap`` the fit of that case's first divergent layer (None below
    the forensics tier). Only ``kind``, ``evidence`` and ``details`` go into the report's JSON
    (:meth:`to_dict`), with the key map under ``details["keymap"]`` (:meth:`KeyMap.to_dict`: a row per key).
    """

    kind: BugClass
    evidence: str
    details: dict[str, Any] = field(default_factory=dict)
    keymap: KeyMap | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, BugClass):
            raise UsageError(f"Diagnosis.kind must be a BugClass, got {self.kind!r}")
        if not isinstance(self.evidence, str):
            raise UsageError(f"Diagnosis.evidence must be a string, got {self.evidence!r}")

    def to_dict(self) -> dict[str, Any]:
        """The report's JSON ``"diagnosis"`` object."""
        details = dict(self.details)
        if self.keymap is not None:
            details["keymap"] = self.keymap.to_dict()
        return {"kind": self.kind.value, "evidence": self.evidence, "details": details}
