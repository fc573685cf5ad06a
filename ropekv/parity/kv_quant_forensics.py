"""Quantized KV scales: cached keys at their positions, the query right, some rows scaled by a constant.

An 8-bit cache stores ``codes = k / s`` and reads ``codes * s'``: under the wrong scale ``s'`` every key
(and value) of the rows it reads keeps its direction and takes the factor ``f = s' / s``, one
constant per layer (per KV head under per-head scales) and per row range (the rows of a prefix hit,
the cached rows against the step's own fresh key). The angle forensics see exact rotations there
(their fit divides lengths out), so this module, like :mod:`ropekv.parity.magnitude`, looks at
lengths once the angles are right: per key and KV head the best scale ``f`` of ``A R(j) r`` towards the
key the kernel used, and its residual. e4m3's rounding leaves a residual of a few percent (3
mantissa bits: a relative step of 2^-3), so a row counts as scaled when ``|f - 1|`` exceeds
:data:`SCALE_TOL` and :data:`~ropekv.parity.magnitude.CLEAN_RATIO` times that residual.

What tells it from a RoPE magnitude error (YaRN's attention factor lost or doubled, which also scales
keys): the query. A KV-scale bug leaves the query alone (queries are never cached); an attention factor
is on the query too, and a factor that is an integer power of the contract's attention factor is left
to :mod:`ropekv.parity.magnitude`.
"""

from __future__ import annotations

import math

import torch

from ..rope import RopeSpec
from .magnitude import CLEAN_RATIO, UNCLEAR, Scaled

SCALE_TOL = 0.05  # |f - 1| a scaled row exceeds: above e4m3's rounding of a whole head's length (~1e-2)
QUERY_TOL = 0.01  # |f - 1| of the query that still counts as right (the query is never quantized)
GROUP_TOL = 0.05  # relative spread of the factors of rows read under one wrong scale
_TINY = 1e-300


def _head_scales(eff: torch.Tensor, expected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and head (``eff``/``expected [N, heads, D]``): the best scale ``f`` of ``expected``
    towards ``eff`` and the relative residual ``|eff - f expected| / |f expected|``, ``[N, heads]``."""
    c, e = eff.to(torch.float64), expected.to(torch.float64)
    ee = (e * e).sum(-1).clamp_min(_TINY)
    f = (c * e).sum(-1) / ee
    resid = (c - f[..., None] * e).norm(dim=-1) / (f.abs() * ee.sqrt()).clamp_min(_TINY)
    return f, resid


def _span(positions: list[int]) -> str:
    p = sorted(positions)
    if len(p) <= 4:
        return ", ".join(map(str, p))
    return f"{p[0]}..{p[-1]}"


def _power_of(f: float, a: float) -> bool:
    """``f`` is ``a^k`` for a nonzero integer ``k`` (``a`` the attention factor, not 1)."""
    if a == 1.0 or a <= 0 or f <= 0:
        return False
    k = math.log(f) / math.log(a)
    return abs(k - round(k)) < 0.05 and round(k) != 0


def _on_e4m3_grid(x: torch.Tensor) -> bool:
    """Every entry of ``x`` is a finite e4m3fn value: what codes dequantized with scale 1 are."""
    return bool(torch.equal(x.to(torch.float8_e4m3fn).to(x.dtype), x)) and bool(x.abs().max() <= 448)


def scaled_rows(
    rope: RopeSpec,
    q_raw: torch.Tensor,
    q_eff: torch.Tensor,
    k_raw: torch.Tensor,
    k_eff: torch.Tensor,
    query_position: int,
    key_positions: torch.Tensor,
    seq_len: int,
    at_position: torch.Tensor,
    fork_offset: int = 0,
) -> Scaled | None:
    """The query ``[H, D]`` right, keys ``[M, KVH, D]`` at their positions (``at_position [M]`` bool) but
    some of them scaled by one constant factor per row group (and per head): a KV-scale mismatch.
    None where the query is scaled too, where no key is, or where what differs is no clean scaling."""
    t, a = query_position, rope.attention_factor
    eq = rope.rotate(q_raw[None].to(torch.float64), torch.tensor([t]), seq_len)[0]  # [H, D]
    fq, _ = _head_scales(q_eff[None], eq[None])
    if bool(((fq - 1).abs() > QUERY_TOL).any()):
        return None  # the query is scaled: an attention factor (rope_magnitude), not the cache's scales
    idx = torch.nonzero(at_position).flatten()
    if idx.numel() == 0:
        return None
    j = key_positions[idx].long()
    ek = rope.rotate(k_raw[idx].to(torch.float64), j, seq_len)  # [M', KVH, D]
    f, resid = _head_scales(k_eff[idx], ek)  # [M', KVH]
    dev = (f - 1).abs()
    clean = (dev > SCALE_TOL) & (dev > CLEAN_RATIO * resid)
    off = clean.all(dim=1)  # every head of the row scaled cleanly
    right = (dev <= SCALE_TOL).all(dim=1)
    if not bool(off.any()) or float((~off & ~right).double().mean()) > UNCLEAR:
        return None
    # rows read under one wrong scale share their factors (one per head); group them by the factors
    groups: list[list[int]] = []
    for i in torch.nonzero(off).flatten().tolist():
        for g in groups:
            if bool(((f[i] / f[g[0]] - 1).abs() <= GROUP_TOL).all()):
                g.append(i)
                break
        else:
            groups.append([i])
    factors = [f[g].mean(0) for g in groups]  # [KVH] each
    if a != 1.0 and all(_power_of(float(x.mean()), a) for x in factors):
        return None  # keys scaled by the attention factor's powers: rope_magnitude's to name
    parts = []
    for g, fac in zip(groups, factors):
        pos = [int(j[i]) for i in g]
        n = len(g)
        per = (
            f"x{float(fac[0]):.4g}"
            if bool(((fac / fac[0] - 1).abs() <= GROUP_TOL).all())
            else ("per head x" + "/".join(f"{float(x):.4g}" for x in fac))
        )
        where = f"{n} key{'' if n == 1 else 's'} {per} (position{'' if n == 1 else 's'} {_span(pos)}"
        if fork_offset and sorted(pos) == list(range(fork_offset)):
            where += f": exactly the {fork_offset} rows reused from the prefix-cache hit"
        codes = k_eff[idx[torch.tensor(g)]].to(torch.float32)
        if _on_e4m3_grid(codes):
            where += "; they read as bare e4m3 codes: dequantized with scale 1, their scale dropped"
        parts.append(where + ")")
    n_right = int(right.sum())
    if n_right:
        parts.append(f"{n_right} key{'' if n_right == 1 else 's'} right (positions {_span(j[right].tolist())})")
    text = (
        "query and angles right, key lengths wrong by one constant factor per row range: the cache's "
        "8-bit codes were dequantized with another scale than the one they were written under: " + ", ".join(parts)
    )
    show = torch.zeros_like(at_position)
    show[idx[off]] = True
    details: dict[str, object] = {
        "key_factors": [[float(x) for x in fac] for fac in factors],
        "scaled_keys": int(off.sum()),
        "scaled_positions": [_span([int(j[i]) for i in g]) for g in groups],
    }
    return Scaled(text, show, details)
