"""Cross spectra and the integer search: where a vector that is a rotation of another really sits.

Each channel pair ``(a, b)`` of a rotated span is a complex number ``z = a + i b``; a rotation to
position ``p`` multiplies pair ``m`` by ``A exp(i p w_m)``. For a raw vector ``r`` and the vector a
kernel used ``c``, the cross spectrum ``X_m = conj(r_m) c_m`` has phase ``p w_m``; the score of a
candidate ``p`` is ``Re sum_m X_m exp(-i p w_m)`` and its *fit* that score over ``sum_m |r_m||c_m|``:
1.0 for an exact rotation whatever its length, about 0 for an unrelated vector. Under M-RoPE the pairs
fall into sections (t, h, w) that turn by their own positions, so scores and positions are per section.

Everything here is pure and vectorized over *cells* (one token and one head each).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...rope import pair_channels

MAX_CANDIDATES = 1 << 18  # integers one search sweeps (a position 2**31 away is reached by a hypothesis)
_SCORE_ENTRIES = 1 << 22  # bounds one [cells, candidates] score block (32 MB in float64)
_TINY = 1e-300


@dataclass(frozen=True, eq=False)
class Spectra:
    """Cross spectra of ``cells`` raw/effective vector pairs over the rotated pairs.

    ``real``/``imag`` ``[cells, n]``: ``conj(r) c`` per pair; ``weight [cells, S]``: ``sum |r_m||c_m|`` per
    section; ``sections [n]``: the section of each pair (0 without M-RoPE); ``w [n]``: the pairs'
    frequencies the positions are searched under."""

    real: torch.Tensor
    imag: torch.Tensor
    weight: torch.Tensor
    sections: torch.Tensor
    w: torch.Tensor

    @property
    def num_sections(self) -> int:
        return int(self.weight.shape[1])


def pairs(rotary_dim: int, layout: str, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel indices ``(first, second)`` ``[rotary_dim // 2]`` of each rotating pair, ``offset`` added."""
    a, b = pair_channels(rotary_dim, layout)
    return a + offset, b + offset


def spectra(
    raw: torch.Tensor,
    eff: torch.Tensor,
    *,
    rotary_dim: int,
    layout: str,
    offset: int,
    w: torch.Tensor,
    sections: torch.Tensor,
    num_sections: int,
) -> Spectra:
    """Cross spectra of ``raw``/``eff`` ``[cells, D]`` (float64) under one pairing."""
    a, b = pairs(rotary_dim, layout, offset)
    ra, rb, ca, cb = raw[:, a], raw[:, b], eff[:, a], eff[:, b]  # [cells, n]
    mag = ((ra * ra + rb * rb) * (ca * ca + cb * cb)).sqrt()
    weight = torch.zeros(raw.shape[0], num_sections, dtype=torch.float64)
    weight.index_add_(1, sections, mag)
    return Spectra(ra * ca + rb * cb, ra * cb - rb * ca, weight, sections, w)


def section_scores(sp: Spectra, positions: torch.Tensor) -> torch.Tensor:
    """Scores ``[cells, C, S]`` of candidate positions ``[cells, C, S]`` (section ``s`` of candidate ``c``
    turning its pairs by ``positions[:, c, s]``)."""
    cells, cands, _ = positions.shape
    per_pair = positions[:, :, sp.sections].to(torch.float64) * sp.w  # [cells, C, n]
    contrib = sp.real[:, None, :] * torch.cos(per_pair) + sp.imag[:, None, :] * torch.sin(per_pair)
    out = torch.zeros(cells, cands, sp.num_sections, dtype=torch.float64)
    out.index_add_(2, sp.sections, contrib)
    return out


def fit_of(sp: Spectra, scores: torch.Tensor) -> torch.Tensor:
    """Fit ``[cells, ...]`` of per-section ``scores [cells, ..., S]``: their sum over the sections' weights."""
    total = sp.weight.sum(1).clamp_min(_TINY)
    return scores.sum(-1) / total.reshape((-1,) + (1,) * (scores.dim() - 2))


def search(sp: Spectra, cells: torch.Tensor, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The best integer of ``candidates [C]`` per section for the ``cells [M]`` (indices) of ``sp``:
    positions ``[M, S]`` int64 and their per-section scores ``[M, S]``. Cost ``M x C x n`` multiply-adds,
    run in blocks of about :data:`_SCORE_ENTRIES` scores."""
    m, s = cells.numel(), sp.num_sections
    best_pos = torch.zeros(m, s, dtype=torch.int64)
    best_score = torch.full((m, s), -torch.inf, dtype=torch.float64)
    if m == 0:
        return best_pos, best_score
    cand = candidates.to(torch.float64)
    for sec in range(s):
        sel = sp.sections == sec
        w = sp.w[sel]
        xr, xi = sp.real[cells][:, sel], sp.imag[cells][:, sel]  # [M, n_s]
        step = max(1, _SCORE_ENTRIES // max(1, m))
        for lo in range(0, cand.numel(), step):
            ang = w[:, None] * cand[None, lo : lo + step]  # [n_s, c]
            score = xr @ torch.cos(ang) + xi @ torch.sin(ang)  # [M, c]
            val, idx = score.max(dim=1)
            better = val > best_score[:, sec]
            best_score[better, sec] = val[better]
            best_pos[better, sec] = candidates[lo + idx[better]]
    return best_pos, best_score


def candidate_range(t: int, positions: torch.Tensor, block_size: int, slots: torch.Tensor) -> torch.Tensor:
    """The integers a search sweeps: ``-(t + 2) .. hi`` (``hi`` past twice the largest position, the
    slots and a block), or, where that is more than :data:`MAX_CANDIDATES` (a sequence shifted far past
    0), the integers near 0 and near the row's positions (hypotheses reach the rest)."""
    top = max(t, int(positions.max()) if positions.numel() else 0)
    hi = max(3 * top + 2 * block_size + 2, int(slots.max()) + 1 if slots.numel() else 0)
    lo = -(top + 2)
    if hi - lo + 1 <= MAX_CANDIDATES:
        return torch.arange(lo, hi + 1)
    low = int(positions.min()) if positions.numel() else 0
    span = min(top - low + 64, MAX_CANDIDATES // 8)
    near0 = torch.arange(-span, span + 1)
    near = torch.arange(max(span + 1, low - span), top + span + 1)
    return torch.cat((near0, near))


def cosine(c: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Per cell ``[cells]``: ``<c, e> / (|c| |e|)`` of ``[cells, D]`` vectors (0 where either is zero)."""
    num = (c * e).sum(-1)
    den = (c.norm(dim=-1) * e.norm(dim=-1)).clamp_min(_TINY)
    out: torch.Tensor = num / den
    return out


def scale_and_residual(c: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per cell: the best scale ``s`` of ``e`` towards ``c`` (``[cells, D]``) and the relative residual
    ``|c - s e| / |s e|`` (inf where ``e`` is zero)."""
    ee = (e * e).sum(-1)
    s = (c * e).sum(-1) / ee.clamp_min(_TINY)
    resid = (c - s[:, None] * e).norm(dim=-1) / (s.abs() * ee.sqrt()).clamp_min(_TINY)
    resid = torch.where(ee > _TINY, resid, torch.full_like(resid, torch.inf))
    return s, resid


def magnitude_profiles(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rotation-invariant profiles ``[cells, n]``: each pair's length ``|x_m|`` over the cell's total,
    what any rotation (any position, any frequencies) leaves unchanged."""
    mag = (x[:, a] ** 2 + x[:, b] ** 2).sqrt()
    out: torch.Tensor = mag / mag.norm(dim=-1, keepdim=True).clamp_min(_TINY)
    return out


def effective_positions(
    raw: torch.Tensor, eff: torch.Tensor, inv_freq: torch.Tensor, layout: str, rotary_dim: int, candidates: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's best integer position of ``candidates [C]`` and its fit, the heads fitted together:
    ``raw, eff [N, H, D]`` -> positions ``[N]`` int64, fits ``[N]`` float64."""
    n_tok, heads, d = raw.shape
    sp = spectra(
        raw.reshape(-1, d).to(torch.float64),
        eff.reshape(-1, d).to(torch.float64),
        rotary_dim=rotary_dim,
        layout=layout,
        offset=0,
        w=inv_freq.to(torch.float64),
        sections=torch.zeros(rotary_dim // 2, dtype=torch.int64),
        num_sections=1,
    )
    summed = Spectra(
        sp.real.reshape(n_tok, heads, -1).sum(1),
        sp.imag.reshape(n_tok, heads, -1).sum(1),
        sp.weight.reshape(n_tok, heads, 1).sum(1),
        sp.sections,
        sp.w,
    )
    pos, score = search(summed, torch.arange(n_tok), candidates)
    return pos[:, 0], score[:, 0] / summed.weight[:, 0].clamp_min(_TINY)
