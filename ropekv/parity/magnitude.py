"""RoPE magnitude: the query and keys sit at their positions but have the wrong length.

The angle forensics (:mod:`ropekv.parity.forensics`) weight every pair by ``|r||c|`` and divide it
out again, so their fit is 1.0 for an exact rotation whatever its length: the attention factor ``A``
that YaRN and LongRoPE put on cos and sin (:attr:`~ropekv.rope.RopeSpec.attention_factor`) never
shows there. This module looks at the length once the angles are known to be right: for a token at
logical position ``p`` with raw ``r`` (the reference's) and effective ``c`` (the kernel's), the
contract says ``c = A R(p) r`` on the rotated channels. The best scale ``s`` in ``c ~ s A R(p) r`` is
1 for a right token; an engine that leaves ``A`` out has ``s = 1 / A`` (``A`` applied 0 times), one
that applies it twice ``s = A``, and every attention logit scales by ``s_query * s_key``.

Noise is told apart from a scaling by the residual: a scaled rotation leaves
``|c - s A R(p) r| / |s A R(p) r|`` at the dtype's rounding (bf16: ~2e-3), while hidden states that
drifted change the vector in every direction and its length only a little (``|s - 1|`` well below
that residual). A token counts as scaled when ``|s - 1|`` exceeds :data:`SCALE_TOL` (above bf16's
relative error, 2^-8) and :data:`CLEAN_RATIO` times its residual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..rope import RopeSpec

SCALE_TOL = 0.01  # |s - 1| a scaled token exceeds: 2.5x bf16's relative error (2^-8), far below any factor's
CLEAN_RATIO = 4.0  # |s - 1| must be this many times the token's residual (a clean scaling, not noise)
UNCLEAR = 0.1  # share of the examined keys that may be neither right nor a clean scaling
_TINY = 1e-300


@dataclass(frozen=True, eq=False)
class Scaled:
    """A magnitude finding: its sentence, the keys that show it (``show [M]`` bool) and its figures."""

    text: str
    show: torch.Tensor
    details: dict[str, object] = field(default_factory=dict)


def _scale(raw: torch.Tensor, eff: torch.Tensor, expected: torch.Tensor, rope: RopeSpec) -> tuple[torch.Tensor, ...]:
    """Per token ``[N]`` (``raw, eff, expected [N, heads, D]``): the best scale ``s`` of ``expected``
    (``A R(p) r``) towards ``eff`` over the rotated channels, the residual, and ``|c| / |r|``."""
    part = slice(rope.rotary_offset, rope.rotary_offset + rope.rotary_dim)
    c, e, r = (x[..., part].to(torch.float64).flatten(1) for x in (eff, expected, raw))  # [N, heads * rd]
    ee = (e * e).sum(1).clamp_min(_TINY)
    s = (c * e).sum(1) / ee
    resid = (c - s[:, None] * e).norm(dim=1) / (s.abs() * ee.sqrt()).clamp_min(_TINY)
    ratio = c.norm(dim=1) / r.norm(dim=1).clamp_min(_TINY)
    return s, resid, ratio


def _times(s: float, a: float) -> str:
    """``s`` (relative to the contract) as a count of attention factors ``a``, where it is one."""
    if a != 1.0 and a > 0:
        k = 1 + math.log(max(s, _TINY)) / math.log(a)
        if abs(k - round(k)) < 0.05:
            n = round(k)
            return f"the attention factor {a:.4f} applied {n} time{'' if n == 1 else 's'} instead of once"
    return f"a factor {s:.4f} beyond the attention factor {a:.4f}"


def _power(s: float, a: float) -> str:
    """`` (A^k)`` where ``s`` is an integer power of the attention factor ``a``, else ""."""
    if a != 1.0 and a > 0:
        k = math.log(max(s, _TINY)) / math.log(a)
        if abs(k - round(k)) < 0.05 and round(k) != 0:
            return f" (A^{round(k)})"
    return ""


def _span(positions: torch.Tensor) -> str:
    p = sorted(int(x) for x in positions.tolist())
    if len(p) <= 4:
        return ", ".join(map(str, p))
    return f"{p[0]}..{p[-1]}"


def _groups(scales: torch.Tensor) -> list[torch.Tensor]:
    """Index groups ``[G][k]`` of ``scales [M]`` whose sorted values lie within SCALE_TOL of their neighbours."""
    order = torch.argsort(scales)
    out: list[list[int]] = []
    prev = None
    for i in order.tolist():
        v = float(scales[i])
        if prev is None or v - prev > SCALE_TOL:
            out.append([])
        out[-1].append(i)
        prev = v
    return [torch.tensor(g, dtype=torch.int64) for g in out]


def scaled_rotation(
    rope: RopeSpec,
    q_raw: torch.Tensor,
    q_eff: torch.Tensor,
    k_raw: torch.Tensor,
    k_eff: torch.Tensor,
    query_position: int,
    key_positions: torch.Tensor,
    seq_len: int,
    at_position: torch.Tensor,
) -> Scaled | None:
    """The query ``[H, D]`` and keys ``[M, KVH, D]`` (raw and effective) are rotations to their logical
    positions (``key_positions [M]``; ``at_position [M]`` bool: the keys the angle fit put there) but
    scaled: their lengths against the contract's ``A R(p) r``. None where every length is right or
    where what differs is not a clean scaling."""
    t, a = query_position, rope.attention_factor
    eq = rope.rotate(q_raw[None].to(torch.float64), torch.tensor([t]), seq_len)  # [1, H, D]
    sq, rq, cq = (x[0] for x in _scale(q_raw[None], q_eff[None], eq, rope))
    idx = torch.nonzero(at_position).flatten()
    if idx.numel() == 0:
        return None
    j = key_positions[idx].long()
    ek = rope.rotate(k_raw[idx].to(torch.float64), j, seq_len)  # [M', KVH, D]
    sk, rk, ck = _scale(k_raw[idx], k_eff[idx], ek, rope)
    dq, dk = (sq - 1).abs(), (sk - 1).abs()
    q_off = bool(dq > SCALE_TOL and dq > CLEAN_RATIO * rq)
    q_unclear = bool(dq > SCALE_TOL) and not q_off
    k_off = (dk > SCALE_TOL) & (dk > CLEAN_RATIO * rk)
    k_unclear = (dk > SCALE_TOL) & ~k_off
    if q_unclear or not (q_off or bool(k_off.any())) or float(k_unclear.double().mean()) > UNCLEAR:
        return None
    parts = [
        f"the query x{float(sq):.4f} (|c|/|r| {float(cq):.4f}: {_times(float(sq), a)})" if q_off else "the query right"
    ]
    score_parts = []
    right = torch.nonzero(~k_off).flatten()
    off = torch.nonzero(k_off).flatten()
    groups = ([right] if right.numel() else []) + [off[g] for g in _groups(sk[off])]
    for g in groups:
        s = float(sk[g].mean()) if bool(k_off[g].all()) else 1.0
        n, where = g.numel(), _span(j[g])
        noun = "key" if n == 1 else "keys"
        if s == 1.0:
            parts.append(f"{n} {noun} right (positions {where})")
        else:
            ratio = float(ck[g].mean())
            at = "position" if n == 1 else "positions"
            parts.append(f"{n} {noun} x{s:.4f} ({at} {where}; |c|/|r| {ratio:.4f}: {_times(s, a)})")
        score = float(sq) * s
        if abs(score - 1) > SCALE_TOL:
            score_parts.append(f"x{score:.4f}{_power(score, a)} against the {noun} at {where}")
    scores = "; scores " + ", ".join(score_parts) if score_parts else ""
    text = (
        f"angles right at the query and every key, lengths wrong (the contract's attention factor is {a:.4f}): "
        + ", ".join(parts)
        + scores
    )
    show_sub = k_off if bool(k_off.any()) else (j == j.max())
    show = torch.zeros_like(at_position)
    show[idx[show_sub]] = True
    details: dict[str, object] = {
        "attention_factor": a,
        "query_scale": float(sq),
        "key_scales": [float(sk[g].mean()) if bool(k_off[g].all()) else 1.0 for g in groups],
        "scaled_keys": int(k_off.sum()),
    }
    return Scaled(text, show, details)
