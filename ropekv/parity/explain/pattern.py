"""What a key map shows when no bug class accounts for it: the deterministic mapping, in words.

Never a bare "unknown" where the map shows a pattern: the keys are grouped by what is wrong with them
(sitting at another position, by which offset or at which single position; turned under another
rotation; scaled; holding another row's content; holding nothing the reference computed), and each
group is said with its positions and the phase that wrote them ("keys 16..19 sit at 16; query at
t"). Where every cell is exact, the sentence says so and points at what else can differ (values,
the mask).
"""

from __future__ import annotations

import torch

from ..keymap.record import KeyMap
from .cells import span_text, which_keys
from .facts import CaseFacts

MAX_GROUPS = 4


def _offset_groups(km: KeyMap, wrong: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Groups of placed-elsewhere cells by what maps them: one constant offset, or one position."""
    k = km.keys
    moved = wrong & k.ok & k.own_content & (k.rotation == 0) & ~k.at_expected
    out: list[tuple[str, torch.Tensor]] = []
    if not bool(moved.any()):
        return out
    off = k.offsets()[..., 0]  # [N, K]
    eff = k.effective[..., 0]
    left = moved.clone()
    for _ in range(MAX_GROUPS):
        if not bool(left.any()):
            break
        vals, counts = torch.unique(off[left], return_counts=True)
        pvals, pcounts = torch.unique(eff[left], return_counts=True)
        if int(pcounts.max()) > int(counts.max()) and int(pcounts.max()) > 1:
            p = int(pvals[pcounts.argmax()])
            grp = left & (eff == p)
            out.append((f"sit at {p}", grp))
        else:
            o = int(vals[counts.argmax()])
            grp = left & (off == o)
            out.append((f"sit at j {o:+d}", grp))
        left &= ~grp
    if bool(left.any()):
        out.append(("sit at other positions, no single offset", left))
    return out


def describe(km: KeyMap, facts: CaseFacts | None = None) -> str:
    """One sentence on what differs at ``km``'s layer (its wrong cells grouped, or that none is)."""
    k, q = km.keys, km.query
    wrong, wq = km.wrong_keys(), km.wrong_query()
    parts: list[str] = []
    if not bool(wq.any()):
        parts.append(f"the query sits at its position {km.query_position}")
    else:
        heads = int(wq.sum())
        eff = sorted(set(q.effective[0, wq, 0].tolist()))
        rot = sorted({km.rotation_name(int(r)) for r in q.rotation[0, wq].tolist()})
        scaled = q.scale[0, wq]
        what = f"at {span_text(eff)}" if bool(q.ok[0, wq].all()) else "no rotation of its raw query fits"
        if bool(q.ok[0, wq].all()) and rot != ["the contract's RoPE"]:
            what += f" under {', '.join(rot)}"
        if bool(q.at_expected[0, wq].all()) and bool((scaled - 1).abs().max() > 0.01):
            what = f"scaled x{float(scaled.mean()):.4g}"
        parts.append(f"{heads} of {q.heads} query heads {what} (position {km.query_position})")
    groups = _offset_groups(km, wrong)
    for text, cells in groups:
        parts.append(f"{which_keys(km, cells, facts)} {text}")
    placed_elsewhere = torch.zeros_like(wrong)
    for _, cells in groups:
        placed_elsewhere |= cells
    rest = wrong & ~placed_elsewhere
    other_rot = rest & k.ok & k.own_content & (k.rotation != 0)
    for r in torch.unique(k.rotation[other_rot]).tolist()[:MAX_GROUPS]:
        cells = other_rot & (k.rotation == r)
        parts.append(f"{which_keys(km, cells, facts)} turn under {km.rotation_name(int(r))}")
    foreign = rest & k.ok & ~k.own_content
    if bool(foreign.any()):
        src = sorted(set(k.source[foreign].tolist()))
        parts.append(f"{which_keys(km, foreign, facts)} hold other rows' keys (rows {span_text(src)})")
    scaled = rest & k.placed() & ((k.scale - 1).abs() > 0.01)
    if bool(scaled.any()):
        parts.append(f"{which_keys(km, scaled, facts)} sit right but scaled x{float(k.scale[scaled].mean()):.4g}")
    lost = rest & ~k.ok
    if bool(lost.any()):
        parts.append(
            f"{which_keys(km, lost, facts)} are no rotation of any reference row (fit {float(k.fit[lost].max()):.2f} "
            "at best): other contents"
        )
    noisy = rest & k.placed() & ~scaled
    if bool(noisy.any()):
        parts.append(
            f"{which_keys(km, noisy, facts)} sit right with a residual of up to {float(k.residual[noisy].max()):.2g}"
        )
    if int((~km.visible).sum()):
        parts.append(f"the kernel read {int((~km.visible).sum())} key(s) the reference hides")
    if km.missed.numel():
        parts.append(
            f"it did not read {km.missed.numel()} key(s) the reference shows ({span_text(km.missed.tolist())})"
        )
    right = int((~wrong).any(1).sum())
    if not bool(wrong.any()) and not bool(wq.any()) and not km.missed.numel() and bool(km.visible.all()):
        return (
            f"layer {km.layer}: the query and all {k.num} keys sit exactly where the contract puts them "
            "(positions, rotation, length): the attention logits here agree within the noise"
        )
    if right:
        parts.append(f"the other {right} keys are right")
    return f"layer {km.layer}: " + "; ".join(parts)
