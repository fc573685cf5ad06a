"""The plug-in interface: a bug class reads a failing case's evidence and answers with a match or None.

Every explanation has one signature, ``explain(evidence) -> Match | None``. The evidence of a case is
its facts (:mod:`.facts`), the key map of its first divergent layer (:mod:`ropekv.parity.keymap`;
None below the forensics tier), the key map of the layer below where that layer's input already
differed (what its values did), and the attention rows that diverged. A match carries the share of
the divergence it accounts for (``score``), the sentence that shows it, and whether it covers every
affected token or only some (a subset of heads, rows or phases). The diagnosis (:mod:`.combine`)
weighs the matches of every failing case.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ...errors import UsageError
from ..bug_class import BugClass
from ..cases import Case
from ..keymap.record import KeyMap
from .facts import CaseFacts

PROMOTE = 0.9  # share of a case's divergence a match must account for to name its class
Scope = Literal["all", "subset"]


@dataclass(frozen=True, eq=False)
class CaseEvidence:
    """One failing case: its facts, the key map of its first divergent layer, and the layer below's
    where that layer's input already differed. ``attention``: the kernel's attention logits of the
    diverging row over the keys it read ``[H, N]`` and the reference's by position ``[H, T]`` (from
    ``reference_origin``)."""

    facts: CaseFacts
    keymap: KeyMap | None = None
    below: KeyMap | None = None
    cached_attention: torch.Tensor | None = None  # [H, N]
    reference_attention: torch.Tensor | None = None  # [H, T] by position from reference_origin
    reference_origin: int = 0  # the position of reference_attention's column 0 (RefRow.origin)
    recorded_positions: torch.Tensor | None = None  # [N] the positions the adapter labelled its keys with
    keys_seen: torch.Tensor | None = None  # [N, KVH, D] the keys the kernel used at the divergent layer


@dataclass(frozen=True)
class Match:
    """A bug class accounting for ``score`` (in [0, 1]) of a case's divergence, with its sentence."""

    kind: BugClass
    score: float
    text: str
    scope: Scope = "all"
    details: dict[str, Any] = field(default_factory=dict)
    shown: tuple[int, ...] = ()  # indices of the keys (in the key map) the sentence is about, quoted as evidence

    def __post_init__(self) -> None:
        if not isinstance(self.kind, BugClass):
            raise UsageError(f"Match.kind must be a BugClass, got {self.kind!r}")
        if not 0.0 <= self.score <= 1.0:
            raise UsageError(f"Match.score must be in [0, 1], got {self.score!r}")


@dataclass(frozen=True)
class Explanation:
    """A bug class as a plug-in: ``explain`` reads one case's evidence; ``shows`` (optional) says
    whether a case that passed should have failed had this class been at work in every token it can
    reach (a passing case where it says True speaks against a match of scope ``all``)."""

    kind: BugClass
    explain: Callable[[CaseEvidence], Match | None]
    shows: Callable[[Case], bool] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, BugClass):
            raise UsageError(f"Explanation.kind must be a BugClass, got {self.kind!r}")
