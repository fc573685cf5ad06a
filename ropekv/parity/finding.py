"""A direct hypothesis's result: a bug class tested by computing what it predicts and measuring the fit,
where the integer search of :mod:`ropekv.parity.forensics` cannot reach or cannot tell it apart
(:mod:`ropekv.parity.position_width`, :mod:`ropekv.parity.block_seam`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .bug_class import BugClass


@dataclass(frozen=True, eq=False)
class Finding:
    """``kind`` with its sentence ``text``; ``show [N]`` bool: the keys the evidence quotes;
    ``key_effective [N]`` int64 / ``key_fit [N]``: each key's position under the hypothesis and its
    fit; ``query_effective`` / ``query_fit``: the query's."""

    kind: BugClass
    text: str
    show: torch.Tensor
    key_effective: torch.Tensor
    key_fit: torch.Tensor
    query_effective: int
    query_fit: float
    details: tuple[tuple[str, object], ...] = ()
