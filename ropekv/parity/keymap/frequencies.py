"""Frequencies estimated from tokens that turned under none the fit knows: another theta, or every
frequency scaled.

For tokens at known positions ``p`` (their logical ones) with cross spectra ``X [cells, n]``, a family
of frequency sets ``w(x)`` is scored by ``sum_cells Re sum_m X_m exp(-i p w_m(x)) / sum |r||c|``:

- ``theta``: the base replaced (``w_m(x) = w_m * x^(-2m / rotary_dim)``, x = theta' / theta): a config
  read from another field, a model's theta swapped for another's;
- ``scale``: every frequency divided by ``x`` (a linear scaling factor lost or invented).

The grid in ``log x`` is fine enough that the phase of the fastest-moving pair at the highest position
moves less than 0.05 rad between neighbours, so the true value's peak cannot fall between two points;
then a golden-section refinement. Tokens at several positions make the peak unique and sharp: the
estimate is exact to far better than 1% whenever the fit is close to 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from .spectral import Spectra

Family = Literal["theta", "scale"]
MAX_CELLS = 64  # cells the estimate reads (spread over positions; the highest kept)
GRID_CELLS = 16  # of those, the cells the grid is scored on (the peaks are refined on all of them)
MAX_GRID = 1 << 17  # grid points per family
MAX_EXACT_GRID = 1 << 12  # grid points of the spec's own theta family (each a call of its frequency function)
PEAKS = 4  # local maxima of a grid refined
RANGE = 1000.0  # x searched in [1 / RANGE, RANGE]
_TINY = 1e-300


@dataclass(frozen=True)
class Estimate:
    family: Family
    x: float  # theta' / theta, or the scale dividing every frequency
    fit: float
    w: torch.Tensor  # [n] the estimated frequencies


def _family_w(w: torch.Tensor, rotary_dim: int, family: Family, x: torch.Tensor) -> torch.Tensor:
    """``[G, n]`` frequencies of the family at ``x [G]``."""
    if family == "theta":
        expo = torch.arange(w.numel(), dtype=torch.float64) * 2 / rotary_dim
        return w[None, :] * x[:, None] ** (-expo[None, :])
    return w[None, :] / x[:, None]


def _score(sp: Spectra, cells: torch.Tensor, pos: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """Fit ``[G]`` of the cells at positions ``pos [M]`` under frequency sets ``ws [G, n]``."""
    xr, xi = sp.real[cells], sp.imag[cells]  # [M, n]
    norm = sp.weight[cells].sum().clamp_min(_TINY)
    out = torch.empty(ws.shape[0], dtype=torch.float64)
    rows = max(1, (1 << 21) // max(1, cells.numel() * ws.shape[1]))
    for lo in range(0, ws.shape[0], rows):
        ang = pos.to(torch.float64)[None, :, None] * ws[lo : lo + rows, None, :]  # [g, M, n]
        out[lo : lo + rows] = (xr * torch.cos(ang) + xi * torch.sin(ang)).sum((1, 2)) / norm
    return out


def _spread(cells: torch.Tensor, positions: torch.Tensor, most: int) -> tuple[torch.Tensor, torch.Tensor]:
    """At most about ``most`` of ``cells [M]``: spread evenly over their positions, the highest quarter kept
    (the highest positions separate nearby frequency sets best)."""
    if cells.numel() <= most:
        return cells, positions
    order = positions.argsort()
    keep = torch.cat((order[-(most // 4) :], order[torch.linspace(0, order.numel() - 1, most).long()]))
    keep = torch.unique(keep)
    return cells[keep], positions[keep]


def _golden(f: Callable[[float], float], lo: float, hi: float, steps: int = 45) -> float:
    """The argmax of ``f`` on ``[lo, hi]`` by golden-section search."""
    g = (5**0.5 - 1) / 2
    for _ in range(steps):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if f(a) >= f(b):
            hi = b
        else:
            lo = a
    return (lo + hi) / 2


def estimate(
    sp: Spectra,
    cells: torch.Tensor,
    positions: torch.Tensor,
    rotary_dim: int,
    theta_spec: Callable[[float], torch.Tensor] | None = None,
) -> Estimate | None:
    """The best theta or scale for ``cells [M]`` of ``sp`` at ``positions [M]`` (their logical ones),
    or None without cells. Only single-section spectra (no M-RoPE). ``theta_spec(x)``: the frequencies
    of the contract's own spec with its theta times ``x`` (its scaling recomputed: YaRN's bands,
    llama3's smoothing); without it the theta family is ``w_m x^(-2m / rotary_dim)`` (exact for RoPE
    without scaling)."""
    if cells.numel() == 0 or sp.num_sections != 1:
        return None
    cells, positions = _spread(cells, positions, MAX_CELLS)
    # The grid costs grid points x cells x pairs: it is scored on fewer cells. A true frequency set fits
    # every cell, so its peak is among the best of any subset's; each peak is then refined on all cells.
    grid_cells, grid_positions = _spread(cells, positions, GRID_CELLS)
    w = sp.w
    p_max = float(positions.abs().max().clamp_min(1))
    span = 2 * math.log(RANGE)
    best: Estimate | None = None
    for fam in ("theta", "scale"):
        family: Family = "theta" if fam == "theta" else "scale"
        expo = (
            torch.arange(w.numel(), dtype=torch.float64) * 2 / rotary_dim if family == "theta" else torch.ones_like(w)
        )
        # d(angle)/d(log x) of pair m: p w_m (2m / rotary_dim) for theta, p w_m for scale
        step = 0.05 / max(float((w * expo).max()) * p_max, 1e-12)
        exact = theta_spec if family == "theta" else None
        n = int(min(MAX_GRID if exact is None else MAX_EXACT_GRID, max(64, span / step)))
        logs = torch.linspace(-span / 2, span / 2, n, dtype=torch.float64)

        def family_w(
            x: torch.Tensor, family: Family = family, exact: Callable[[float], torch.Tensor] | None = exact
        ) -> torch.Tensor:
            if exact is None:
                return _family_w(w, rotary_dim, family, x)
            return torch.stack([exact(float(v)) for v in x.tolist()])

        fits = _score(sp, grid_cells, grid_positions, family_w(logs.exp()))
        # the best local maxima, each refined between its neighbours
        left = torch.cat((fits[:1], fits[:-1]))
        right = torch.cat((fits[1:], fits[-1:]))
        maxima = torch.nonzero((fits >= left) & (fits >= right)).flatten()
        for i in maxima[fits[maxima].argsort(descending=True)[:PEAKS]].tolist():
            lo, hi = float(logs[max(0, i - 1)]), float(logs[min(n - 1, i + 1)])
            v = _golden(lambda u: float(_score(sp, cells, positions, family_w(torch.tensor([u]).exp()))[0]), lo, hi)
            ws = family_w(torch.tensor([v]).exp())[0]
            fit = float(_score(sp, cells, positions, ws[None])[0])
            if best is None or fit > best.fit + 1e-9:
                best = Estimate(family, math.exp(v), fit, ws)
    return best
