"""What the explanations share: which cells sit where a bug would put them, how much of a case's
divergence that is, and how to say which keys those are.

A *cell* is a token at a head (:mod:`ropekv.parity.keymap.record`). The divergence of a case is its
wrong key cells, its wrong query heads (weighted so that the query counts as one key) and the keys the
kernel read that the reference hides or missed that it shows (each one key); an explanation's score is
the share of that it accounts for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..keymap.record import KeyMap
from .evidence import Scope
from .facts import CaseFacts


@dataclass(frozen=True, eq=False)
class Cells:
    """Key cells ``[N, K]`` and query heads ``[H]`` an explanation accounts for, and mask errors."""

    keys: torch.Tensor
    query: torch.Tensor
    masked: int = 0  # keys read that the reference hides, or shown and not read, accounted for

    def __or__(self, other: Cells) -> Cells:
        return Cells(self.keys | other.keys, self.query | other.query, self.masked + other.masked)


def nothing(km: KeyMap) -> Cells:
    return Cells(torch.zeros_like(km.keys.fit, dtype=torch.bool), torch.zeros(km.query.heads, dtype=torch.bool))


def _at(fits_eff: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    """``[N, K]``: effective ``[N, K, S]`` equals the predicted ``[N]`` or ``[N, S]`` in every section."""
    if pred.dim() == 1:
        pred = pred[:, None]
    return (fits_eff == pred[:, None, :]).all(-1)


def keys_at(km: KeyMap, predicted: torch.Tensor, rotation: int = 0) -> torch.Tensor:
    """``[N, K]``: key cells with their own content under ``rotation`` that sit at ``predicted``
    (``[N]``, or ``[N, S]`` per section) and fit there."""
    k = km.keys
    return k.ok & k.own_content & (k.rotation == rotation) & _at(k.effective, predicted)


def query_at(km: KeyMap, predicted: int | torch.Tensor, rotation: int = 0) -> torch.Tensor:
    """``[H]``: query heads under ``rotation`` that sit at ``predicted`` and fit there."""
    q = km.query
    p = (
        torch.as_tensor(predicted).reshape(1, -1)
        if not isinstance(predicted, torch.Tensor)
        else predicted.reshape(1, -1)
    )
    return (q.ok & (q.rotation == rotation) & _at(q.effective, p))[0]


def divergence_size(km: KeyMap) -> float:
    """The divergence in key units: wrong key cells over K, wrong query heads over H, masked keys."""
    kv, h = km.keys.heads, km.query.heads
    masked = int((~km.visible).sum()) + int(km.missed.numel())
    return float(km.wrong_keys().sum()) / kv + float(km.wrong_query().sum()) / h + masked


def share(km: KeyMap, cells: Cells) -> float:
    """The share of ``km``'s divergence the explained ``cells`` account for (0 where nothing diverges)."""
    total = divergence_size(km)
    if total <= 0:
        return 0.0
    kv, h = km.keys.heads, km.query.heads
    wk, wq = km.wrong_keys(), km.wrong_query()
    done = float((cells.keys & wk).sum()) / kv + float((cells.query & wq).sum()) / h + cells.masked
    return max(0.0, min(1.0, done / total))


def span_text(values: list[int]) -> str:
    """``3``, ``3, 7``, ``17..60``, ``0..3, 12..15`` (contiguous runs), at most four runs then "...."."""
    v = sorted(set(values))
    runs: list[tuple[int, int]] = []
    for x in v:
        if runs and x == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], x)
        else:
            runs.append((x, x))
    parts = [f"{a}" if a == b else (f"{a}, {b}" if b == a + 1 else f"{a}..{b}") for a, b in runs]
    if len(parts) > 4:
        return ", ".join(parts[:3]) + f", ... {parts[-1]} ({len(v)} in all)"
    return ", ".join(parts)


def which_keys(km: KeyMap, cells: torch.Tensor, facts: CaseFacts | None = None) -> str:
    """Which keys ``cells [N, K]`` marks, in words: their positions, the heads where not all, and the
    phase that wrote them where they are exactly one phase's keys ("the 3 keys the decode steps
    wrote", "keys 17..60 (prefill chunks 2..4)")."""
    rows = cells.any(1)
    pos = km.keys.positions[rows].tolist()
    if not pos:
        return "no key"
    heads = torch.nonzero(cells[rows].any(0)).flatten().tolist()
    n = len(pos)
    noun = "key" if n == 1 else "keys"
    where = f"{noun} {span_text(pos)}"
    if len(heads) < km.keys.heads:
        where += f" (KV head{'s' if len(heads) > 1 else ''} {span_text(heads)} of {km.keys.heads})"
    if facts is not None:
        phase = phases_of(pos, facts, km.keys.positions.tolist())
        if phase:
            where += f" ({phase})"
    return where


def phases_of(positions: list[int], facts: CaseFacts, read: list[int] | None = None) -> str:
    """ "written by X" where ``positions`` are exactly the keys (among those the kernel ``read``) that
    some phases of the case wrote, and not every key read; "" otherwise."""
    spans = facts.spans()
    hit = [s for s in spans if any(p in s for p in positions)]
    seen = set(read) if read is not None else set(positions)
    covered = set(positions)
    if not hit or not all(all(p in covered for p in seen if p in s) for s in hit):
        return ""
    if all(p in covered for p in seen):
        return ""  # every key read: the phases say nothing more
    names = [s.name for s in hit]
    if len(names) > 2 and all(n.startswith("prefill chunk") for n in names):
        names = [f"prefill chunks {names[0].split()[-1]}..{names[-1].split()[-1]}"]
    return "written by " + " and ".join(names)


def explained(
    km: KeyMap, keys: torch.Tensor | None = None, query: torch.Tensor | None = None, masked: int = 0
) -> Cells:
    """A :class:`Cells` from optional masks (absent: none)."""
    none = nothing(km)
    return Cells(none.keys if keys is None else keys, none.query if query is None else query, masked)


def scope_of(km: KeyMap, cells: Cells, informative: torch.Tensor | None = None) -> Scope:
    """``"all"`` when every informative key cell (``informative [N, K]``; default every cell) is among
    ``cells``, else ``"subset"``."""
    inf = torch.ones_like(cells.keys) if informative is None else informative
    return "all" if bool((cells.keys | ~inf).all()) else "subset"


def moved(km: KeyMap) -> torch.Tensor:
    """``[N, K]``: key cells of their own content, under the contract's rotation, at another position."""
    k = km.keys
    return k.ok & k.own_content & (k.rotation == 0) & ~k.at_expected


def query_offset(km: KeyMap) -> int | None:
    """The offset of the query heads from their position (section 0), where every head fits and the
    heads off their position agree on it (a subset of heads may be off: a per-head table or a
    head-parallel rank's own offset), else None; 0 when every head is at its position."""
    q = km.query
    if not bool(q.ok.all()) or not bool((q.rotation == 0).all()):
        return None
    d = q.offsets()[0, :, 0]
    off = d[d != 0]
    if off.numel() == 0:
        return 0
    return int(off[0]) if bool((off == off[0]).all()) else None


def right_elsewhere(km: KeyMap, cells: torch.Tensor) -> str:
    """ ", the N other keys are right" for the exact keys outside ``cells`` ("" when none)."""
    exact = km.key_exact().all(1) & ~cells.any(1)
    n = int(exact.sum())
    return "" if n == 0 else f"; the {n} other key{'s are' if n > 1 else ' is'} right"


def rows_of(cells: torch.Tensor) -> tuple[int, ...]:
    """The key indices ``cells [N, K]`` marks, in order."""
    return tuple(int(i) for i in torch.nonzero(cells.any(1)).flatten().tolist())


def quote_keys(km: KeyMap, shown: tuple[int, ...], count: int = 3) -> list[str]:
    """Up to ``count`` keys of ``shown`` (spread from first to last) as the evidence quotes them:
    ``logical j, slot s, effective e`` (``effective e0/e1 by head`` where the heads differ, ``no integer
    fits (fit f)`` where nothing fits), then the query: ``query logical t, effective e``."""
    k, q = km.keys, km.query
    if len(shown) > count:
        shown = tuple(shown[round(i * (len(shown) - 1) / (count - 1))] for i in range(count))
    out = []
    for i in shown:
        out.append(
            f"logical {int(k.positions[i])}, slot {int(km.slots[i])}, {_effective(k.effective[i, :, 0], k.fit[i], k.ok[i])}"
        )
    out.append(f"query logical {km.query_position}, {_effective(q.effective[0, :, 0], q.fit[0], q.ok[0])}")
    return out


def _effective(eff: torch.Tensor, fit: torch.Tensor, ok: torch.Tensor) -> str:
    if not bool(ok.any()):
        return f"no integer fits (fit {float(fit.max()):.3f})"
    vals = sorted(set(eff[ok].tolist()))
    if len(vals) == 1 and bool(ok.all()):
        return f"effective {vals[0]}"
    return (
        "effective " + "/".join(str(int(e)) if bool(o) else "-" for e, o in zip(eff.tolist(), ok.tolist())) + " by head"
    )
