"""The shape most position bugs share: the query and some keys sit where a function of their
positions (and the case's facts) puts them, everything else is right.

:func:`position_match` takes a predicted position per key (and optionally for the query), finds the
cells that sit exactly there while their logical position says otherwise, and returns a match whose
score is their share of the case's divergence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..bug_class import BugClass
from .cells import Cells, keys_at, query_at, right_elsewhere, rows_of, scope_of, share, which_keys
from .evidence import CaseEvidence, Match


def position_match(
    ev: CaseEvidence,
    kind: BugClass,
    *,
    keys: torch.Tensor | None = None,  # [N], or [N, S] per M-RoPE section
    query: int | None = None,
    informative: torch.Tensor | None = None,
    text: Callable[[str, bool], str],
    min_keys: int = 1,
    details: dict[str, object] | None = None,
) -> Match | None:
    """``kind`` where cells sit at ``keys [N]`` (where that differs from their position and
    ``informative [N]`` allows) and, if given, the query at ``query``. ``text(which, query_moved)``
    makes the sentence from the keys' description. None where fewer than ``min_keys`` keys (and no
    query) sit there."""
    km = ev.keymap
    if km is None or km.rope is None:
        return None
    j = km.keys.positions
    k_cells = torch.zeros_like(km.keys.fit, dtype=torch.bool)
    if keys is not None:
        differs = (keys != km.keys.expected).any(1) if keys.dim() == 2 else keys != j
        if informative is not None:
            differs &= informative
        k_cells = keys_at(km, keys) & differs[:, None]
    q_cells = torch.zeros(km.query.heads, dtype=torch.bool)
    if query is not None and query != ev.facts.query_position:
        q_cells = query_at(km, query)
    if int(k_cells.any(1).sum()) < min_keys and not bool(q_cells.any()):
        return None
    cells = Cells(k_cells, q_cells)
    score = share(km, cells)
    if score <= 0:
        return None
    inf = None if informative is None else informative[:, None].expand_as(k_cells)
    which = which_keys(km, k_cells, ev.facts) if bool(k_cells.any()) else ""
    sentence = text(which, bool(q_cells.any())) + right_elsewhere(km, k_cells)
    return Match(kind, score, sentence, scope_of(km, cells, inf), dict(details or {}), rows_of(k_cells))


def rotation_match(
    ev: CaseEvidence,
    kind: BugClass,
    kinds: tuple[str, ...],
    text: Callable[[str, list[str], bool], str],
    **details: object,
) -> Match | None:
    """``kind`` where cells sit at their positions under a rotation of one of ``kinds`` (a kind of
    :class:`~ropekv.parity.keymap.rotations.Rotation`) instead of the contract's.
    ``text(which, rotation names, query turned so)`` makes the sentence."""
    km = ev.keymap
    if km is None:
        return None
    wanted = [i for i, r in enumerate(km.rotations) if r.kind in kinds]
    if not wanted:
        return None
    idx = torch.tensor(wanted)
    k, q = km.keys, km.query
    k_cells = k.ok & k.own_content & k.at_expected & torch.isin(k.rotation, idx)
    q_cells = (q.ok & q.at_expected & torch.isin(q.rotation, idx))[0]
    if not bool(k_cells.any()) and not bool(q_cells.any()):
        return None
    cells = Cells(k_cells, q_cells)
    score = share(km, cells)
    if score <= 0:
        return None
    used = torch.unique(torch.cat((k.rotation[k_cells], q.rotation[0][q_cells]))).tolist()
    names = [km.rotations[int(i)].name for i in used]
    which = which_keys(km, k_cells, ev.facts) if bool(k_cells.any()) else ""
    info = dict(details)
    for i in used:
        info.update({key: v for key, v in km.rotations[int(i)].details.items() if v is not None})
    sentence = text(which, names, bool(q_cells.any())) + right_elsewhere(km, k_cells)
    return Match(kind, score, sentence, scope_of(km, cells), info, rows_of(k_cells))


def offset_match(
    ev: CaseEvidence,
    kind: BugClass,
    offset: int,
    since: int,
    what: str,
    **details: object,
) -> Match | None:
    """``kind`` where the query sits at ``t + offset`` and the keys written from position ``since`` on
    (the steps after the operation) at ``j + offset``: a rotation offset ``offset`` out of step with the
    logical positions. ``what`` says why (the operation's bug), for the sentence."""
    km = ev.keymap
    if km is None or offset == 0:
        return None
    j, t = km.keys.positions, ev.facts.query_position
    after = j >= since
    pred = torch.where(after, j + offset, j)

    def text(which: str, query: bool) -> str:
        out = f"logical {t}, effective {t + offset}: {what}" if query else what
        return out + (f"; {which} (written after it) sit at j {offset:+d} too" if which else "")

    info: dict[str, object] = {"offset": offset, **details}
    found = position_match(ev, kind, keys=pred, query=t + offset, informative=after, text=text, details=info)
    if found is None or not bool(query_at(km, t + offset).any()):
        return None
    return found
