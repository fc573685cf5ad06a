"""Forensics of position index width: the query and keys sit at their positions wrapped in 16 or 32 bits.

An engine that narrows its positions to ``bits`` bits (two's complement) rotates position ``p`` at
``wrap(p) = ((p + 2**(bits - 1)) mod 2**bits) - 2**(bits - 1)``: 40,039 in 16 bits is
``40,039 - 2**16 = -25,497``. The hypothesis is tested directly: the wrapped position of the query and
of every key is computed and its fit measured, so it holds at positions no integer search sweeps
(``2**31 + n``). It names :attr:`~ropekv.parity.bug_class.BugClass.POSITION_WRAPPED` when the query
fits its wrapped position (not its logical one), every key fits its logical or its wrapped position,
and some key sits at its logical one (otherwise everything wrapped alike and no score changed).
"""

from __future__ import annotations

import torch

from .bug_class import BugClass
from .finding import Finding

WIDTHS = (16, 32)  # the index widths tried, narrowest first
_TINY = 1e-300


def wrap(positions: torch.Tensor, bits: int) -> torch.Tensor:
    """``positions`` (int64) as a signed ``bits``-bit index holds them, in int64."""
    half = 1 << (bits - 1)
    return torch.remainder(positions + half, 1 << bits) - half


def _fit(x: torch.Tensor, norm: torch.Tensor, positions: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Fit of cross spectra ``X [N, n]`` to rotations at ``positions [N]``: ``Re sum X exp(-i p w) / norm``.
    Angles from the int64 positions in float64 (``p w`` to 2**-52 relative)."""
    ang = positions.to(torch.float64)[:, None] * w[None, :]  # [N, n]
    score = (x.real * torch.cos(ang) + x.imag * torch.sin(ang)).sum(-1)
    return score / norm.clamp_min(_TINY)


def _ranges(p: list[int]) -> str:
    return ", ".join(map(str, p)) if len(p) <= 4 else f"{p[0]}..{p[-1]}"


def wrapped(
    t: int,
    key_positions: torch.Tensor,
    qx: torch.Tensor,
    qn: torch.Tensor,
    kx: torch.Tensor,
    kn: torch.Tensor,
    w: torch.Tensor,
    *,
    fit_ok: float,
    most: float,
) -> Finding | None:
    """The query at ``t`` (cross spectrum ``qx [1, n]``, weight ``qn [1]``) and keys at ``key_positions [N]``
    (``kx [N, n]``, ``kn [N]``) under frequencies ``w [n]``: a wrap in the narrowest width that fits, or None."""
    j = key_positions.long()
    for bits in WIDTHS:
        wt = int(wrap(torch.tensor([t]), bits)[0])
        if wt == t:
            continue
        qf = float(_fit(qx, qn, torch.tensor([wt]), w)[0])
        if qf < fit_ok:
            continue
        wj = wrap(j, bits)
        fj, fw = _fit(kx, kn, j, w), _fit(kx, kn, wj, w)
        at_wrapped = (fw > fj) & (wj != j)
        eff = torch.where(at_wrapped, wj, j)
        fit = torch.maximum(fj, fw)
        ok = fit >= fit_ok
        true = ok & ~at_wrapped
        if int(ok.sum()) < most * j.numel() or not bool(true.any()):
            continue
        m = (t - wt) >> bits
        power = f"2**{bits}" if m == 1 else f"{m} x 2**{bits}"
        moved, kept = j[ok & at_wrapped].tolist(), j[true].tolist()
        keys = (
            f"{len(moved)} key(s) ({_ranges(moved)}) wrapped with it, {len(kept)} at their logical positions "
            f"({_ranges(kept)})"
            if moved
            else f"the {len(kept)} keys sit at their logical positions ({_ranges(kept)})"
        )
        text = (
            f"query logical {t}, effective {wt} = {t} - {power}: positions wrapped in a {bits}-bit index "
            f"(a signed int{bits} holds at most {(1 << (bits - 1)) - 1}); {keys}"
        )
        return Finding(
            BugClass.POSITION_WRAPPED,
            text,
            show=ok & at_wrapped if moved else true & (j == j.max()),
            key_effective=eff,
            key_fit=fit,
            query_effective=wt,
            query_fit=qf,
            details=(("index_bits", bits), ("wrapped_keys", len(moved))),
        )
    return None
