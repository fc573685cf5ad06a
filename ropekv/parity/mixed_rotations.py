"""Mixed rotations: one cache holding keys rotated under two specs, each over its own rows.

LongRoPE has exactly two frequency sets: ``short_factor`` for a sequence that fits in
``original_max_position_embeddings`` and ``long_factor`` past it (:meth:`~ropekv.rope.RopeSpec.inv_freq`).
An engine that picks one per forward (a prefill chunk's end, a batch's longest row, the length reached
at each decode step) and never turns cached keys again ends up with early rows under one set and later
rows under the other (uzu #604, vLLM #27414, llama.cpp #24875); the query, at the decode's length,
turns under the set the contract says for it.

Each key is fitted to both specs at its own logical position: for raw ``r`` (the reference's) and
effective ``c`` (the kernel's), ``e = R_spec(j) r`` and the fit ``sum_pairs Re(conj(e_m) c_m) /
sum_pairs |e_m||c_m|`` (over heads and channel pairs; 1.0 for an exact rotation whatever its length,
as in :mod:`ropekv.parity.forensics`). A key is *decisive* for a spec when it fits it
(:data:`~ropekv.parity.forensics.FIT_OK`) and the other spec's misfit is :data:`DECISIVE` times its
own plus :data:`FLOOR` (bf16 storage costs ~1e-5 of fit); a key fitting both alike (position 0, where
every rotation is the identity) takes the label of its nearest decisive neighbour. The finding needs
decisive keys under both specs, every label change between contiguous ranges of rows (at most
:data:`MAX_RUNS` ranges), the query fitting one of the specs and at least :data:`~ropekv.parity.forensics.MOST`
of the keys fitting one. Other faults on a LongRoPE model (keys at ``2j``, at 0, another theta) fit
neither spec and are left to the general forensics; a dynamic NTK cache (a continuum of lengths, not
two specs) is never examined here: that is ``stale_dynamic_scaling``.
"""

from __future__ import annotations

import torch

from ..rope import RopeSpec, pair_channels
from .bug_class import BugClass
from .diagnosis import Diagnosis
from .forensics import FIT_OK, MOST, ForensicInput

DECISIVE = 10.0  # the other spec's misfit must be this many times the fitting spec's (plus FLOOR)
FLOOR = 1e-4  # ... plus this: 10x bf16 storage's misfit (~1e-5), far below one position's phase at pair 0
MAX_RUNS = 4  # contiguous ranges a mixed cache may hold (chunks flipping back and forth under concurrency)
_TINY = 1e-300
_NAMES = ("short", "long")


def _fit(
    rope: RopeSpec, raw: torch.Tensor, eff: torch.Tensor, positions: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token ``[N]``: the fit of ``eff`` to ``raw [N, heads, D]`` rotated to ``positions [N]`` under
    ``rope``'s frequencies for ``seq_len``, over the rotated channel pairs, and its weight
    ``sum_pairs |e_m||c_m|``."""
    first, second = pair_channels(rope.rotary_dim, rope.layout)
    first, second = first + rope.rotary_offset, second + rope.rotary_offset
    e = rope.rotate(raw.to(torch.float64), positions, seq_len)  # [N, heads, D]
    c = eff.to(torch.float64)
    ea, eb, ca, cb = e[..., first], e[..., second], c[..., first], c[..., second]  # [N, heads, n]
    dot = (ea * ca + eb * cb).sum(dim=(1, 2))
    norm = ((ea * ea + eb * eb) * (ca * ca + cb * cb)).sqrt().sum(dim=(1, 2))
    return dot / norm.clamp_min(_TINY), norm


def _labels(fits: torch.Tensor) -> torch.Tensor:
    """``fits [N, 2]`` (short, long) -> per token 0 (short), 1 (long), 2 (fits both alike), -1 (neither)."""
    ok = fits >= FIT_OK
    miss = (1 - fits).clamp_min(0)
    short = ok[:, 0] & (miss[:, 1] > DECISIVE * miss[:, 0] + FLOOR)
    long = ok[:, 1] & (miss[:, 0] > DECISIVE * miss[:, 1] + FLOOR)
    out = torch.full((fits.shape[0],), -1, dtype=torch.int64)
    out[ok.any(1)] = 2
    out[short] = 0
    out[long] = 1
    return out


def _runs(positions: torch.Tensor, labels: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Contiguous ranges ``(first, last, label, count)`` of the fitting keys by position; a key that fits
    both specs alike joins the range of its nearest decisive key (the earlier one on a tie)."""
    order = torch.argsort(positions)
    pos = positions[order].tolist()
    lab = labels[order].tolist()
    keep = [i for i, v in enumerate(lab) if v >= 0]
    decisive = [i for i in keep if lab[i] < 2]
    runs: list[list[int]] = []
    for i in keep:
        v = lab[i]
        if v == 2:
            v = lab[min(decisive, key=lambda d: (abs(pos[d] - pos[i]), pos[d]))]
        if runs and runs[-1][2] == v:
            runs[-1][1], runs[-1][3] = pos[i], runs[-1][3] + 1
        else:
            runs.append([pos[i], pos[i], v, 1])
    return [(a, b, v, n) for a, b, v, n in runs]


def _span(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}..{hi}"


def diagnose_mixed(inp: ForensicInput) -> Diagnosis | None:
    """``mixed_rotations`` where ``inp``'s keys (a LongRoPE contract's) sit at their positions under
    LongRoPE's short factors over one range of rows and its long factors over another; None otherwise
    (another RoPE, a clean row, or keys that fit neither spec)."""
    rope = inp.rope
    orig = rope.scaling.original_max_position_embeddings
    if rope.scaling.rope_type != "longrope" or orig is None:
        return None
    lengths = (orig, orig + 1)  # the short factors up to the original length, the long ones past it
    if torch.equal(rope.inv_freq(lengths[0]), rope.inv_freq(lengths[1])):
        return None  # equal factor lists: one spec, nothing can be mixed
    t = inp.query_position
    seq_len = inp.seq_len if inp.seq_len is not None else t + 1
    contract = 1 if torch.equal(rope.inv_freq(seq_len), rope.inv_freq(lengths[1])) else 0
    j = inp.key_positions.detach().cpu().long()
    k_raw, k_eff = inp.k_raw.detach().cpu(), inp.k_eff.detach().cpu()
    q_raw, q_eff = inp.q_raw.detach().cpu()[None], inp.q_eff.detach().cpu()[None]
    tq = torch.tensor([t])
    (ks, weight), (kl, _) = (_fit(rope, k_raw, k_eff, j, s) for s in lengths)
    k_fits = torch.stack((ks, kl), dim=1)  # [N, 2]
    q_fits = torch.stack([_fit(rope, q_raw, q_eff, tq, s)[0] for s in lengths], dim=1)  # [1, 2]
    labels, q_label = _labels(k_fits), int(_labels(q_fits)[0])
    if q_label < 0 or not bool((labels == 0).any()) or not bool((labels == 1).any()):
        return None
    if float((labels >= 0).double().mean()) < MOST:
        return None  # too many keys fit neither spec: something else is wrong with them
    runs = _runs(j, labels)
    if len(runs) > MAX_RUNS:
        return None
    misfit = int((labels < 0).sum())
    q_name = "both" if q_label == 2 else _NAMES[q_label]
    ranges = [
        f"keys at positions {_span(a, b)} rotated under LongRoPE's {_NAMES[v]} factors"
        if i == 0
        else f"{_span(a, b)} under its {_NAMES[v]} factors"
        for i, (a, b, v, _) in enumerate(runs)
    ]
    relation = ">" if contract == 1 else "<="
    query = (
        f"the query at {t} under the {q_name} factors"
        if q_label < 2
        else f"the query at {t} fits both (too close to 0 to tell)"
    )
    text = (
        ", ".join(ranges) + f"; the contract says {_NAMES[contract]} for all (sequence length {seq_len} {relation} "
        f"original_max_position_embeddings {orig}); {query}"
        + (f"; {misfit} key(s) fit neither" if misfit else "")
        + ": one cache holds two rotations (the factors chosen per forward, by a chunk's or step's own "
        "length, and cached keys never turned again)"
    )
    best, fitting = k_fits.max(dim=1).values, labels >= 0
    fit = float((best[fitting] * weight[fitting]).sum() / weight[fitting].sum().clamp_min(_TINY))
    details: dict[str, object] = {
        "runs": [[a, b, _NAMES[v]] for a, b, v, _ in runs],
        "contract_factors": _NAMES[contract],
        "query_factors": q_name,
        "switch_length": orig,
        "seq_len": seq_len,
        "short_keys": int(sum(n for _, _, v, n in runs if v == 0)),
        "long_keys": int(sum(n for _, _, v, n in runs if v == 1)),
        "misfit_keys": misfit,
        "examined_keys": int(j.numel()),
    }
    return Diagnosis(
        BugClass.MIXED_ROTATIONS,
        text,
        details,
        query_effective=t,
        key_effective=tuple(int(p) if ok else None for p, ok in zip(j.tolist(), fitting.tolist())),
        fit=max(0.0, min(1.0, fit)),
    )
