"""Forensics at the first divergent layer: where did the query and each key really sit?

Pure: tensors in, a frozen :class:`~ropekv.parity.diagnosis.Diagnosis` out (its kind a
:class:`~ropekv.parity.bug_class.BugClass`). Method: each channel pair of a
vector is a complex number ``z = a + i b`` (``a`` the pair's first channel, as in
:func:`ropekv.rope.pair_channels`). :func:`ropekv.rope.apply_rotation` multiplies it by
``A exp(i p w_m)``, so for raw ``r`` and effective ``c`` the cross spectrum ``X_m = sum_heads conj(r_m) c_m``
has phase ``p w_m``. The effective position is the integer maximizing ``Re sum_m X_m exp(-i p w_m)``
(the ``|r|^2 c/r`` weighting); its *fit*, that maximum over ``sum |r_m||c_m|``, is 1.0 for an exact
rotation whatever the attention factor ``A``.

:func:`diagnose` (first match wins; "most" = at least :data:`MOST` of the examined keys that fit):

0. Direct hypotheses, tested by their fit rather than found by the search: the query (and some keys)
   at their positions wrapped in 16 or 32 bits -> ``position_wrapped``
   (:mod:`ropekv.parity.position_width`); then the case operation's hypotheses; then misfit keys
   exactly the first recomputed rows of a non-aligned prefix hit's seam block -> ``block_seam``
   (:mod:`ropekv.parity.block_seam`).
1. Unless the query and more than 1 - MOST of the keys fit (:data:`FIT_OK`) integer rotations under the
   contract: the other pairing fits -> ``layout_mismatch``; for length-dependent RoPE, keys fit the
   frequencies of an earlier length while the query fits the current ones -> ``stale_dynamic_scaling``;
   everything fits angles computed as ``position * inv_freq`` in bf16/fp16 -> ``low_precision_angles``;
   every pair keeps its magnitude (|c_m| ~ A |r_m|, still a rotation) -> ``frequency_mismatch`` with the
   query's theta (or uniform scale) estimated by a 1-D search; else ``unknown``.
2. Otherwise compare effective positions ``p`` (keys at ``j = 0`` left out where ``R(0) = I`` hides the
   bug): handed-off keys at ``2j`` and later ones at ``j`` -> ``rotate_on_transfer``; keys at ``2j`` ->
   ``double_rotation``; at 0 -> ``missing_rotation``; at their slot -> ``slot_as_position``; keys past
   the prefix at ``j - P`` -> ``ignored_prefix_offset``; the keys past the first block at ``j mod B`` ->
   ``block_local_position``; query and keys at their positions rounded to bf16/fp16 (past 256 / 2048 the
   format rounds the position itself: 513 turns as 512) -> ``low_precision_angles``; query and keys
   shifted alike -> ``unknown`` (a global shift changes no logit); keys right, query off ->
   ``query_position_offset``; query off and the newest keys off with it (the newest where the query is,
   later steps never further ahead, the older keys right: a step offset gone wrong, e.g. taken from a
   ring's fill count) -> ``query_position_offset`` with those keys named; query right, keys (all or some) off by one constant ->
   ``key_position_offset``; all at their positions with the query's length right and cached keys
   scaled by one constant per row range (8-bit codes read under another scale) -> ``kv_scale_mismatch``
   (:mod:`ropekv.parity.kv_quant_forensics`); lengths off by the attention factor -> ``rope_magnitude``
   (:mod:`ropekv.parity.magnitude`); all right but a residual phase growing with position (rank correlation
   >= 0.5, or 0.3 when self-parity passed; >= :data:`RES_TOL` at the newest keys and 3x the oldest) ->
   ``low_precision_angles``; all right and no such trend -> ``unknown`` with fit ~1 (a clean row).

Keys beyond :data:`MAX_KEYS` are subsampled for the integer search (bounded cost up to 8192 tokens);
every key is still checked against the named hypotheses for ``key_effective``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from ..errors import UsageError
from ..rope import RopeSpec, pair_channels
from . import block_seam, kv_quant_forensics, magnitude, position_width
from .bug_class import BugClass
from .diagnosis import Diagnosis
from .finding import Finding

FIT_OK = 0.98  # a token "fits" an explanation at this weighted fit (bf16 storage costs ~1e-5)
MOST = 0.9  # share of the examined keys a vote needs (robust to a few noisy keys)
MAG_TOL = 0.02  # mean relative deviation of |c_m| from A |r_m| that still counts as "a rotation"
RES_TOL = 3e-3  # rad: residual phase at the newest keys that counts as an angle error (bf16 storage ~5e-4, flat)
MAX_KEYS = 256  # keys examined by the full integer search; the others are checked against hypotheses
MAX_CANDIDATES = 1 << 18  # integers one search sweeps (a position 2**31 away from 0 cannot be swept)
_TINY = 1e-300


@dataclass(frozen=True)
class OpHypothesis:
    """What a cache operation's bug would look like at the divergent row (``ropekv.parity.ops``).

    ``target``: ``"query"`` (the query sits at ``t + o`` for one ``o`` in ``offsets`` while the keys it
    reads are right or moved alike), ``"keys"`` (the keys at ``positions`` sit at ``j + offsets[0]``
    while the query is right) or ``"misfit"`` (the keys that are no rotation of their token's key at
    all are exactly among ``positions``). ``text`` is the explanation that goes into the evidence.
    """

    kind: BugClass
    target: Literal["query", "keys", "misfit"]
    text: str
    offsets: tuple[int, ...] = ()
    positions: tuple[int, ...] = ()


@dataclass(frozen=True, eq=False)
class ForensicInput:
    """One decode row at the first divergent layer; see the module docstring for the method."""

    rope: RopeSpec  # the contract's spec (what the rotation should be)
    q_raw: torch.Tensor  # [H, D] reference raw (pre-RoPE) query of the decode row
    q_eff: torch.Tensor  # [H, D] the query as the engine's kernel used it
    k_raw: torch.Tensor  # [N, KVH, D] reference raw keys
    k_eff: torch.Tensor  # [N, KVH, D] the keys as the engine's kernel used them
    query_position: int  # logical position t of the decode row
    key_positions: torch.Tensor  # [N] logical positions
    key_slots: torch.Tensor  # [N] physical slot of each key in the sequence's cache
    fork_offset: int = 0  # prefix length P of a prefix-cache hit (0 = none)
    block_size: int = 1
    handoff_len: int = 0  # tokens (positions < this) that arrived through a handoff
    self_parity_passed: bool | None = None
    seq_len: int | None = None  # length the correct frequencies are for; default query_position + 1
    op_hypotheses: tuple[OpHypothesis, ...] = ()  # the case's cache operation, if any

    def __post_init__(self) -> None:
        d, n = self.rope.head_dim, self.key_positions.shape[0] if self.key_positions.dim() == 1 else -1
        if self.q_raw.dim() != 2 or self.q_raw.shape != self.q_eff.shape or self.q_raw.shape[1] != d:
            raise UsageError(
                f"forensics: q_raw/q_eff must both be [H, {d}], got {tuple(self.q_raw.shape)}/{tuple(self.q_eff.shape)}"
            )
        if (
            self.k_raw.dim() != 3
            or self.k_raw.shape != self.k_eff.shape
            or self.k_raw.shape[2] != d
            or self.k_raw.shape[0] != n
            or n < 1
            or tuple(self.key_slots.shape) != (n,)
        ):
            raise UsageError(
                f"forensics: k_raw/k_eff must both be [N, KVH, {d}] with N >= 1 positions and slots; "
                f"got {tuple(self.k_raw.shape)}/{tuple(self.k_eff.shape)}, positions "
                f"{tuple(self.key_positions.shape)}, slots {tuple(self.key_slots.shape)}"
            )
        if self.block_size < 1 or self.fork_offset < 0 or self.handoff_len < 0 or self.query_position < 0:
            raise UsageError("forensics: block_size must be >= 1; fork_offset, handoff_len, query_position >= 0")


# ---------------------------------------------------------------------- spectral core


def _complex_pairs(x: torch.Tensor, layout: str, rotary_dim: int) -> torch.Tensor:
    """``x [..., D]`` -> complex128 ``[..., rotary_dim // 2]``: first channel of a pair real, second imaginary."""
    a, b = pair_channels(rotary_dim, layout)
    x = x.to(torch.float64)
    return torch.complex(x[..., a], x[..., b])


def _cross(raw: torch.Tensor, eff: torch.Tensor, layout: str, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross spectrum ``X [N, n]`` (sum over heads of conj(r) c) and its weight ``[N]`` (sum of |r||c|)."""
    a, b = pair_channels(rotary_dim, layout)
    raw, eff = raw.to(torch.float64), eff.to(torch.float64)
    ra, rb, ca, cb = raw[..., a], raw[..., b], eff[..., a], eff[..., b]  # [N, H, n]
    # conj(r) c = (ra ca + rb cb) + i (ra cb - rb ca); real arithmetic is several times faster than complex.
    x = torch.complex((ra * ca + rb * cb).sum(dim=1), (ra * cb - rb * ca).sum(dim=1))  # [N, n]
    return x, ((ra * ra + rb * rb) * (ca * ca + cb * cb)).sqrt().sum(dim=(1, 2))


def _fit_at(x: torch.Tensor, norm: torch.Tensor, ang: torch.Tensor) -> torch.Tensor:
    """Fit of ``X [N, n]`` to phases ``ang [N, ..., n]``: ``Re sum X exp(-i ang) / norm``, shape ``[N, ...]``."""
    shape = (x.shape[0],) + (1,) * (ang.dim() - 2) + (x.shape[1],)
    xr, xi = x.real.reshape(shape), x.imag.reshape(shape)
    rows = max(1, (1 << 20) // max(1, ang[0].numel()))  # bounds the temporaries to ~1M entries a chunk
    score = torch.cat(
        [
            (xr[i : i + rows] * torch.cos(a) + xi[i : i + rows] * torch.sin(a)).sum(-1)
            for i, a in ((i, ang[i : i + rows]) for i in range(0, ang.shape[0], rows))
        ]
    )
    return score / norm.clamp_min(_TINY).reshape((-1,) + (1,) * (score.dim() - 1))


def _search(
    x: torch.Tensor, norm: torch.Tensor, inv_freq: torch.Tensor, candidates: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Best integer of ``candidates [C]`` for each row of ``X [N, n]``: positions ``[N]`` int64, fits ``[N]``."""
    ang = inv_freq.to(torch.float64)[:, None] * candidates.to(torch.float64)[None, :]  # [n, C]
    cos, sin = torch.cos(ang), torch.sin(ang)
    pos, fit = [], []
    for i in range(0, x.shape[0], 256):  # bounds the [rows, C] score matrix
        score = x[i : i + 256].real @ cos + x[i : i + 256].imag @ sin  # [rows, C]
        best, idx = score.max(dim=1)
        pos.append(candidates[idx].long())
        fit.append(best / norm[i : i + 256].clamp_min(_TINY))
    return torch.cat(pos), torch.cat(fit)


def effective_positions(
    raw: torch.Tensor, eff: torch.Tensor, inv_freq: torch.Tensor, layout: str, rotary_dim: int, candidates: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Effective integer rotation position of each token and its fit in [0, 1].

    ``raw, eff [N, H, D]``; ``inv_freq [rotary_dim // 2]``; ``candidates [C]`` integers.
    Returns ``positions [N]`` (int64, taken from ``candidates``) and ``fit [N]`` (float64).
    """
    x, norm = _cross(raw, eff, layout, rotary_dim)
    return _search(x, norm, inv_freq, candidates)


@dataclass(frozen=True, eq=False)
class _Analysis:
    """The query's and every key's cross spectra and best integer positions under one pairing."""

    qx: torch.Tensor  # [1, n] the query's cross spectrum
    qn: torch.Tensor  # [1] its weight
    kx: torch.Tensor  # [N, n] the keys' cross spectra
    kn: torch.Tensor  # [N]
    qp: int  # the query's effective position
    qf: float  # and its fit
    kp: torch.Tensor  # [N] int64 each key's effective position (search, or the best named hypothesis)
    kf: torch.Tensor  # [N] its fit


class _Done(Protocol):
    """A pattern's diagnosis from its kind, sentence and the keys that show it (``show [M]`` bool)."""

    def __call__(self, kind: BugClass, text: str, show: torch.Tensor, **details: object) -> Diagnosis: ...


# ---------------------------------------------------------------------- helpers


def _sample_keys(pos: torch.Tensor, inp: ForensicInput) -> torch.Tensor:
    """Indices ``[M <= MAX_KEYS]`` of the keys given the full search: first and last, the 32 newest,
    those within 4 of the prefix and handoff boundaries, and evenly spaced ones."""
    n = pos.shape[0]
    if n <= MAX_KEYS:
        return torch.arange(n)
    order = torch.argsort(pos)
    keep = [order[:1], order[-32:]]
    for b in (inp.fork_offset, inp.handoff_len):
        if b > 0:
            keep.append(torch.nonzero((pos - b).abs() <= 4).flatten()[:16])
    fixed = torch.unique(torch.cat(keep))
    spread = order[torch.linspace(0, n - 1, MAX_KEYS - fixed.numel()).round().long()]
    sample: torch.Tensor = torch.unique(torch.cat((fixed, spread)))
    return sample


def _mode(values: torch.Tensor) -> int:
    vals, counts = torch.unique(values, return_counts=True)
    return int(vals[counts.argmax()]) if vals.numel() else 0


def _most(consider: torch.Tensor, match: torch.Tensor) -> bool:
    """At least MOST of the ``consider`` keys ``match`` (and there is at least one to consider)."""
    n = int(consider.sum())
    return n > 0 and int((consider & match).sum()) >= MOST * n


def _spread(idx: torch.Tensor, k: int = 3) -> list[int]:
    """Up to ``k`` entries of ``idx`` spread from first to last."""
    idx = idx.flatten()
    if idx.numel() <= k:
        return idx.tolist()
    return idx[torch.linspace(0, idx.numel() - 1, k).round().long()].tolist()


def _wfit(qf: float, qn: torch.Tensor, kf: torch.Tensor, kn: torch.Tensor) -> float:
    """Weighted mean fit of the query (``qn [1]``) and the examined keys (``kf, kn [M]``), weights sum |r||c|."""
    norm = torch.cat((qn, kn))
    return float((torch.cat((torch.tensor([qf], dtype=torch.float64), kf)) * norm).sum() / norm.sum().clamp_min(_TINY))


def _diagnosis(
    kind: BugClass,
    text: str,
    q: tuple[int, int | None, float],
    keys: list[str],
    eff: torch.Tensor,
    fit_all: torch.Tensor,
    fit: float,
    **details: object,
) -> Diagnosis:
    t, q_eff, q_fit = q
    qtxt = f"query logical {t}, " + (
        f"effective {q_eff}" if q_eff is not None else f"no integer fits (fit {q_fit:.3f})"
    )
    key_eff = tuple(int(p) if f >= FIT_OK else None for p, f in zip(eff.tolist(), fit_all.tolist()))
    evidence = "; ".join([text, *keys, qtxt])
    return Diagnosis(
        kind,
        evidence,
        dict(details),
        query_effective=q_eff,
        key_effective=key_eff,
        fit=float(max(0.0, min(1.0, fit))),
    )


# ---------------------------------------------------------------------- diagnosis


def diagnose(inp: ForensicInput) -> Diagnosis:
    """Estimate the effective position of the query and every key and name the bug class (a :class:`BugClass`)."""
    inp = dataclasses.replace(
        inp,
        **{
            f.name: getattr(inp, f.name).detach().cpu()
            for f in dataclasses.fields(inp)
            if isinstance(getattr(inp, f.name), torch.Tensor)
        },
    )
    rope, t, rd = inp.rope, inp.query_position, inp.rope.rotary_dim
    seq_len = inp.seq_len if inp.seq_len is not None else t + 1
    w = rope.inv_freq(seq_len)  # [n]
    pos, slots = inp.key_positions.long(), inp.key_slots.long()  # [N]
    sel = _sample_keys(pos, inp)  # [M]
    hi = 2 * max(t, int(pos.max())) + 2 * max(1, inp.block_size) + 2
    hi = min(max(hi, int(slots.max()) + 1), 4 * (t + 1) + 64)  # slots beyond this are still tried per key
    cands = _candidates(t, hi, pos)  # [C]

    def analyse(layout: str) -> _Analysis:
        qx, qn = _cross(inp.q_raw[None], inp.q_eff[None], layout, rd)  # [1, n], [1]
        kx, kn = _cross(inp.k_raw, inp.k_eff, layout, rd)  # [N, n], [N]
        p, f = _search(torch.cat((qx, kx[sel])), torch.cat((qn, kn[sel])), w, cands)  # one phase table
        qp, qf, sp, sf = p[:1], f[:1], p[1:], f[1:]
        d_q = int(qp[0]) - t
        d = sp - pos[sel]
        c = _mode(d[(sf >= FIT_OK) & (d != 0)])
        # Every key against the named hypotheses (cheap), then the sampled keys' search where better.
        hyps = torch.stack(
            (pos, 2 * pos, 0 * pos, slots, pos - inp.fork_offset, pos % inp.block_size, pos + d_q, pos + c), dim=1
        )  # [N, 8]
        hf = _fit_at(kx, kn, hyps.double()[:, :, None] * w)  # [N, 8]
        best, idx = hf.max(dim=1)
        kp, kf = hyps.gather(1, idx[:, None])[:, 0], best
        better = sf > kf[sel]
        kp[sel], kf[sel] = torch.where(better, sp, kp[sel]), torch.where(better, sf, kf[sel])
        return _Analysis(qx=qx, qn=qn, kx=kx, kn=kn, qp=int(qp[0]), qf=float(qf[0]), kp=kp, kf=kf)

    a = analyse(rope.layout)
    wrap = position_width.wrapped(t, pos, a.qx, a.qn, a.kx, a.kn, w, fit_ok=FIT_OK, most=MOST)
    if wrap is not None:  # before the operations' hypotheses: a shift's keys are right, the query wrapped
        return _from_finding(inp, wrap, a)
    if inp.op_hypotheses:
        found = _diagnose_op(inp, a)
        if found is not None:
            return found
    joint = block_seam.seam(t, a.qp, a.qf, pos, a.kp, a.kf, inp.fork_offset, inp.block_size, fit_ok=FIT_OK)
    if joint is not None:
        return _from_finding(inp, joint, a)
    misfit = a.kf[sel] < FIT_OK
    if a.qf < FIT_OK or float(misfit.double().mean()) > 1 - MOST:
        return _diagnose_misfit(inp, a, analyse, w, seq_len, sel)
    return _diagnose_pattern(inp, a, sel)


def _candidates(t: int, hi: int, pos: torch.Tensor) -> torch.Tensor:
    """The integers the search sweeps: ``-(t + 2)..hi``, or, where that is more than
    :data:`MAX_CANDIDATES` (a sequence shifted far past 0), the integers near 0 and near the positions
    the row holds (every named hypothesis, the wrapped positions included, is still tried directly)."""
    if hi + t + 3 <= MAX_CANDIDATES:
        return torch.arange(-(t + 2), hi + 1)
    lo = int(pos.min())
    span = min(t - lo + 64, MAX_CANDIDATES // 8)
    return torch.cat((torch.arange(-span, span + 1), torch.arange(max(span + 1, lo - span), t + span + 1)))


def _from_finding(inp: ForensicInput, f: Finding, a: _Analysis) -> Diagnosis:
    """A direct hypothesis's finding as a diagnosis, the keys it shows quoted with their positions."""
    ok = f.key_fit >= FIT_OK
    show = torch.nonzero(f.show).flatten()
    keys = [_tok(inp, int(i), int(f.key_effective[i]) if ok[i] else None, float(f.key_fit[i])) for i in _spread(show)]
    fit = _wfit(f.query_fit, a.qn, f.key_fit[ok], a.kn[ok]) if ok.any() else f.query_fit
    return _diagnosis(
        f.kind,
        f.text,
        (inp.query_position, f.query_effective if f.query_fit >= FIT_OK else None, f.query_fit),
        keys,
        f.key_effective,
        f.key_fit,
        fit,
        **dict(f.details),
        query_offset=f.query_effective - inp.query_position,
        examined_keys=int(f.key_fit.numel()),
        fitting_keys=int(ok.sum()),
    )


def _diagnose_op(inp: ForensicInput, a: _Analysis) -> Diagnosis | None:
    """The case's cache-operation hypotheses, over every key (each was tried at its named offsets)."""
    t, kp, kf = inp.query_position, a.kp, a.kf
    j = inp.key_positions.long()
    ok = kf >= FIT_OK
    d, d_q = kp - j, a.qp - t
    q_ok = a.qf >= FIT_OK
    everything = torch.arange(j.numel())
    for h in inp.op_hypotheses:
        at = torch.isin(j, torch.tensor(h.positions, dtype=torch.int64)) if h.positions else torch.zeros_like(ok)
        if h.target == "query" and q_ok and d_q != 0 and d_q in h.offsets and _most(ok, (d == 0) | (d == d_q)):
            show = torch.nonzero(ok & (j >= t - 2)).flatten()
            text = f"logical {t}, effective {t + d_q}: {h.text}"
        elif (
            h.target == "keys"
            and q_ok
            and d_q == 0
            and h.offsets
            and bool((at & ok).any())
            and _most(at & ok, d == h.offsets[0])
            and _most(ok & ~at, d == 0)
        ):
            show = torch.nonzero(at & ok).flatten()
            text = f"keys logical j, effective j {h.offsets[0]:+d} (the {int(at.sum())} shifted keys): {h.text}"
        elif h.target == "misfit" and q_ok and bool((~ok).any()) and bool((~ok & ~at).sum() == 0):
            # Every key outside the hypothesis fits and the query is right: even one misfitting key among
            # the named positions explains the divergence (a restore that missed one slot), not noise.
            show = torch.nonzero(~ok).flatten()
            bad, named = int((~ok).sum()), int(at.sum())
            some = (
                "" if bad == named else f" ({bad} of the {named} such positions in view; the other {named - bad} fit)"
            )
            text = (
                f"{bad} key(s) at positions {j[~ok].tolist()[:8]} are no rotation of those tokens' "
                f"keys (fit {float(kf[~ok].max()):.2f} at best): {h.text}{some}"
            )
        else:
            continue
        keys = [_tok(inp, int(i), int(kp[i]) if ok[i] else None, float(kf[i])) for i in _spread(show)]
        fit = _wfit(a.qf, a.qn, kf[ok], a.kn[ok]) if ok.any() else a.qf
        return _diagnosis(
            h.kind,
            text,
            (t, a.qp if q_ok else None, a.qf),
            keys,
            kp,
            kf,
            fit,
            query_offset=d_q,
            examined_keys=int(everything.numel()),
            fitting_keys=int(ok.sum()),
        )
    return None


def _tok(inp: ForensicInput, i: int, p: int | None, f: float | None = None) -> str:
    head = f"logical {int(inp.key_positions[i])}, slot {int(inp.key_slots[i])}, "
    return head + (f"effective {p}" if p is not None else f"no integer fits (fit {f:.3f})")


def _diagnose_pattern(inp: ForensicInput, a: _Analysis, sel: torch.Tensor) -> Diagnosis:
    """Query and keys are integer rotations under the contract: match positions against the patterns."""
    t, kp, kf = inp.query_position, a.kp[sel], a.kf[sel]
    j, s = inp.key_positions.long()[sel], inp.key_slots.long()[sel]
    ok = kf >= FIT_OK
    inf = ok & (j > 0)  # R(0) = I: j = 0 says nothing about multiplicative bugs
    d, d_q = kp - j, a.qp - t
    fit = _wfit(a.qf, a.qn, kf, a.kn[sel])

    def done(kind: BugClass, text: str, show: torch.Tensor, **details: object) -> Diagnosis:
        keys = [_tok(inp, int(sel[i]), int(kp[i])) for i in _spread(torch.nonzero(show).flatten())]
        details.update(query_offset=d_q, examined_keys=int(sel.numel()), fitting_keys=int(ok.sum()))
        return _diagnosis(kind, text, (t, a.qp, a.qf), keys, a.kp, a.kf, fit, **details)

    H, P, B = inp.handoff_len, inp.fork_offset, inp.block_size
    early, late = inf & (j < H), ok & (j >= H)
    if H > 0 and early.any() and late.any() and _most(early, kp == 2 * j) and _most(late, d == 0):
        return done(
            BugClass.ROTATE_ON_TRANSFER,
            f"the {H} handed-off tokens sit at 2j, later keys at j: the handoff rotated already rotated keys once more",
            early,
        )
    if _most(inf, kp == 2 * j):
        return done(
            BugClass.DOUBLE_ROTATION, "keys sit at twice their position (rotated when written and again when read)", inf
        )
    if _most(inf, kp == 0):
        return done(BugClass.MISSING_ROTATION, "keys sit at position 0 (stored raw, read as if rotated)", inf)
    if (inf & (s != j)).any() and _most(inf, kp == s):
        return done(
            BugClass.SLOT_AS_POSITION,
            "keys sit at their physical slot instead of their logical position",
            inf & (s != j),
        )
    after, before = ok & (j >= P), inf & (j < P)
    if P > 0 and after.any() and _most(after, kp == j - P) and (not before.any() or _most(before, d == 0)):
        return done(
            BugClass.IGNORED_PREFIX_OFFSET,
            f"keys after the {P}-token cached prefix sit at j - {P}" + (" and so does the query" if d_q == -P else ""),
            after,
        )
    # Below the first block boundary j mod B is j itself: only the keys past it can show the bug.
    if B > 1 and _most(inf & (j >= B), kp == j % B):
        return done(
            BugClass.BLOCK_LOCAL_POSITION, f"keys sit at their index inside their block (j mod {B})", inf & (j >= B)
        )
    rounded = _rounded_positions(inp, a, sel, done)
    if rounded is not None:
        return rounded
    if d_q != 0 and _most(ok, d == d_q):
        return done(
            BugClass.UNKNOWN, f"query and keys all shifted by {d_q}: a global shift changes no logit", ok, offset=d_q
        )
    if d_q != 0 and not (ok & (d != 0)).any():
        return done(
            BugClass.QUERY_POSITION_OFFSET, f"keys are right but the query sits at t {d_q:+d}", ok & (j > t - 3)
        )
    if d_q != 0:
        stepped = _step_offset(inp, a, sel, done)
        if stepped is not None:
            return stepped
    nz = ok & (d != 0)
    c = _mode(d[nz])
    if d_q == 0 and nz.any() and _most(nz, d == c) and _most(ok, (d == 0) | (d == c)):
        return done(
            BugClass.KEY_POSITION_OFFSET,
            f"{int(nz.sum())} of {int(ok.sum())} keys sit at j {c:+d} while the query is right",
            nz,
            offset=c,
        )
    if d_q == 0 and _most(ok, d == 0):
        seq_len = inp.seq_len if inp.seq_len is not None else t + 1
        k_raw, k_eff = inp.k_raw[sel], inp.k_eff[sel]
        at = ok & (d == 0)
        rows = kv_quant_forensics.scaled_rows(
            inp.rope, inp.q_raw, inp.q_eff, k_raw, k_eff, t, j, seq_len, at, inp.fork_offset
        )
        if rows is not None:  # the query right, cached rows scaled: 8-bit codes read under another scale
            return done(BugClass.KV_SCALE_MISMATCH, rows.text, rows.show, **rows.details)
        scaled = magnitude.scaled_rotation(inp.rope, inp.q_raw, inp.q_eff, k_raw, k_eff, t, j, seq_len, ok & (d == 0))
        if scaled is not None:  # the angles are right, the lengths are not (an attention factor lost or doubled)
            return done(BugClass.ROPE_MAGNITUDE, scaled.text, scaled.show, **scaled.details)
        return _residual_trend(inp, a, sel, done)
    return done(
        BugClass.UNKNOWN,
        f"no single pattern: query offset {d_q}, key offsets {sorted(set(d[ok].tolist()))[:8]}",
        ok & (d != 0),
    )


def _rounded_positions(inp: ForensicInput, a: _Analysis, sel: torch.Tensor, done: _Done) -> Diagnosis | None:
    """Angles computed as ``position x inv_freq`` in bf16/fp16 round the position itself once it passes
    the format's integers (256 in bf16, 2048 in fp16): 513 turns as 512, 259 as 260. Where the query and
    the keys sit exactly at their rounded positions, and some of those differ from the logical ones, the
    integer search sees offsets of a step or two that no position bug explains."""
    t, kp = inp.query_position, a.kp[sel]
    j, ok = inp.key_positions.long()[sel], a.kf[sel] >= FIT_OK
    for dt in (torch.bfloat16, torch.float16):
        rj = j.to(dt).long()  # [M] the positions as that format holds them
        rt = int(torch.tensor([t]).to(dt).long()[0])
        moved = ok & (rj != j)
        if a.qp != rt or not (moved.any() or rt != t) or not _most(ok, kp == rj):
            continue
        if moved.any() and not _most(moved, kp == rj):
            continue
        name = str(dt).replace("torch.", "")
        limit = 256 if dt == torch.bfloat16 else 2048
        shown = moved if moved.any() else ok & (j == j.max())
        example = f"{t} -> {rt}" if rt != t else f"{int(j[moved][0])} -> {int(rj[moved][0])}"
        return done(
            BugClass.LOW_PRECISION_ANGLES,
            f"query and keys sit at their positions rounded to {name} ({example}; {name} holds integers "
            f"exactly only up to {limit}): angles computed as position x inv_freq in {name}, an error that "
            "grows with position",
            shown,
            angle_dtype=name,
            rounded_keys=int(moved.sum()),
        )
    return None


def _step_offset(inp: ForensicInput, a: _Analysis, sel: torch.Tensor, done: _Done) -> Diagnosis | None:
    """The query off by ``d_q`` and the newest keys off with it: the steps that wrote those keys turned
    them at a rotation offset that stopped following the logical position, the step of the query
    included (the newest key sits where the query does), while the older keys are right. A constant
    offset gives every such key ``d_q``; an offset stuck at a count (a ring's fill count: the rows the
    cache keeps) gives each later step a more negative one. Returns None where the keys do not fit."""
    t, kp, kf = inp.query_position, a.kp[sel], a.kf[sel]
    j, ok = inp.key_positions.long()[sel], kf >= FIT_OK
    d, d_q = kp - j, a.qp - t
    off, right = ok & (d != 0), ok & (d == 0)
    if not off.any() or not _most(torch.ones_like(ok), ok):
        return None
    newest = int(torch.nonzero(ok).flatten()[j[ok].argmax()])
    if int(d[newest]) != d_q or (right.any() and int(j[off].min()) <= int(j[right].max())):
        return None
    order = torch.argsort(j[off])
    offsets = d[off][order]  # by position, oldest first
    if bool((offsets[1:] > offsets[:-1]).any()):  # a later step never turns further ahead than an earlier one
        return None
    n_off, n_right, n_read = int(off.sum()), int(right.sum()), int(inp.key_positions.numel())
    steps = sorted(set(offsets.tolist()), reverse=True)
    at = f"at j {', '.join(f'{o:+d}' for o in steps[:6])} (the newest where the query is)"
    if n_right == 0:
        keys = f"and all {n_off} keys the kernel read are off too, {at}"
    elif n_off == 1:
        keys = "and so does the key its step wrote"
    elif len(steps) == 1:
        keys = f"and so do the {n_off} newest keys"
    else:
        keys = f"and the {n_off} newest keys are off too, {at}"
    text = f"the query sits at t {d_q:+d} (effective {a.qp}) {keys}"
    text += f"; the {n_right} older keys are right: the rotation offset" if n_right else ": the rotation offset"
    text += " stopped following the logical position at the steps that wrote the newest keys"
    if a.qp == n_read:
        text += (
            f"; effective {a.qp} = the {n_read} keys the kernel read: an offset taken from the cache's fill count "
            "(the rows a ring keeps), not from the tokens seen"
        )
    return done(BugClass.QUERY_POSITION_OFFSET, text, off, offset=d_q, offset_keys=n_off)


def _residual_trend(inp: ForensicInput, a: _Analysis, sel: torch.Tensor, done: _Done) -> Diagnosis:
    """All at the right integers: a weighted residual phase growing with position means a low-precision
    angle table (bf16 angles lose ~p w 2^-9 rad); otherwise the rotation is clean at this layer."""
    j = inp.key_positions.long()[sel].double()
    w = inp.rope.inv_freq(inp.seq_len if inp.seq_len is not None else inp.query_position + 1)
    z = a.kx[sel] * torch.exp(-1j * j[:, None] * w)  # [M, n] residual per pair
    res = ((z.abs() * z.angle() ** 2).sum(1) / z.abs().sum(1).clamp_min(_TINY)).sqrt()  # [M] rad
    keep = (j > 0) & (a.kf[sel] >= FIT_OK)
    rj, rr = j[keep], res[keep]
    rho, top, low = 0.0, 0.0, 0.0
    if rj.numel() >= 8:
        ranks = torch.stack((rj.argsort().argsort(), rr.argsort().argsort())).double()
        rho = float(torch.corrcoef(ranks)[0, 1].nan_to_num(0.0))
        k = max(1, rj.numel() // 10)
        top, low = float(rr[rj.argsort()[-k:]].mean()), float(rr[rj.argsort()[:k]].mean())
    seq_len = inp.seq_len if inp.seq_len is not None else inp.query_position + 1
    stale = _stale_frequencies(inp, a, w, seq_len, sel, {}, strict=False)
    if stale is not None:  # a phase trend from frequencies of an earlier length, not from precision
        return stale
    need = 0.3 if inp.self_parity_passed else 0.5  # self-parity passing points at a shared angle table
    details = dict(residual_rank_corr=rho, residual_newest_rad=top, residual_oldest_rad=low)
    if rho >= need and top >= RES_TOL and top >= 3 * low:
        sp = " (the engine agrees with itself: both of its paths share the table)" if inp.self_parity_passed else ""
        return done(
            BugClass.LOW_PRECISION_ANGLES,
            f"positions are right but the phase error grows with position, "
            f"{low:.3g} rad at the oldest keys to {top:.3g} rad at the newest{sp}",
            keep,
            **details,
        )
    odd = a.kf[sel] < FIT_OK
    if bool(odd.any()):
        # A few keys that are no rotation of their own token's key while every other key and the query sit
        # at their positions: shown as possible wrong contents at those rows, not dropped as noise.
        pos = inp.key_positions.long()[sel][odd]
        return done(
            BugClass.UNKNOWN,
            f"query and keys sit at their logical positions: no RoPE error visible at this layer, except "
            f"{int(odd.sum())} of {int(odd.numel())} key(s), at positions {pos.tolist()[:8]}, that are no rotation "
            f"of their own tokens' keys (fit {float(a.kf[sel][odd].max()):.2f} at best): those rows may hold other "
            "contents (stale or another token's keys)",
            odd,
            misfit_keys=int(odd.sum()),
            **details,
        )
    return done(
        BugClass.UNKNOWN,
        "query and keys sit at their logical positions: no RoPE error visible at this layer",
        keep & (j == j.max()),
        **details,
    )


def _diagnose_misfit(
    inp: ForensicInput,
    a: _Analysis,
    analyse: Callable[[str], _Analysis],
    w: torch.Tensor,
    seq_len: int,
    sel: torch.Tensor,
) -> Diagnosis:
    """Not integer rotations under the contract: other pairing, stale length, low precision, frequencies."""
    rope, t, rd = inp.rope, inp.query_position, inp.rope.rotary_dim
    j = inp.key_positions.long()[sel]
    q = (t, a.qp if a.qf >= FIT_OK else None, a.qf)
    bad = torch.nonzero(a.kf[sel] < FIT_OK).flatten()
    bad_toks = [_tok(inp, int(sel[i]), None, float(a.kf[sel][i])) for i in _spread(bad)]
    base = dict(query_fit=a.qf, misfit_keys=int(bad.numel()), examined_keys=int(sel.numel()))

    other = "gptj" if rope.layout == "neox" else "neox"
    b = analyse(other)
    fits_other = b.kf[sel] >= FIT_OK
    misfit = a.kf[sel] < FIT_OK
    # Either everything is paired the other way, or only the decode side is: the query (and the keys
    # it wrote) fit the other pairing while the prefill's keys still fit the contract's.
    everything = _most(torch.ones_like(j, dtype=torch.bool), fits_other)
    decode_side = a.qf < FIT_OK and (not bool(misfit.any()) or _most(misfit, fits_other))
    if b.qf >= FIT_OK and (everything or decode_side):
        toks = [_tok(inp, int(sel[i]), int(b.kp[sel][i])) for i in _spread(torch.arange(sel.numel()))]
        fit = _wfit(b.qf, b.qn, b.kf[sel], b.kn[sel])
        what = (
            "query and keys are exact rotations"
            if everything and not decode_side
            else "the decode side's query (and the keys it wrote) are exact rotations, the prefill's keys are not,"
        )
        return _diagnosis(
            BugClass.LAYOUT_MISMATCH,
            f"contract pairs {rope.layout} but {what} under the {other} pairing",
            (t, b.qp, b.qf),
            toks,
            b.kp,
            b.kf,
            fit,
            **base,
            effective_layout=other,
        )

    qx, qn, kn = a.qx, a.qn, a.kn[sel]
    stale = _stale_frequencies(inp, a, w, seq_len, sel, base, strict=True)
    if stale is not None:
        return stale

    for dt in (torch.bfloat16, torch.float16):
        if dt == torch.float16 and max(t, int(j.max())) > 65504:
            continue
        qf = float(_fit_at(qx, qn, (torch.tensor([t]).to(dt)[:, None] * w.to(dt)[None]).double())[0])
        pos = inp.key_positions.long()  # [N]
        fit_all = _fit_at(a.kx, a.kn, (pos.to(dt)[:, None] * w.to(dt)[None]).double())  # [N]
        if qf >= FIT_OK and _most(torch.ones_like(j, dtype=torch.bool), fit_all[sel] >= FIT_OK):
            name = str(dt).replace("torch.", "")
            return _diagnosis(
                BugClass.LOW_PRECISION_ANGLES,
                f"query and keys match angles computed as position x inv_freq "
                f"in {name}, an error that grows with position",
                (t, t, qf),
                bad_toks,
                pos,
                fit_all,
                _wfit(qf, qn, fit_all[sel], kn),
                **base,
                angle_dtype=name,
            )

    dev_q = _magnitude_dev(inp.q_raw[None], inp.q_eff[None], rope.layout, rd)  # [1]
    dev = _magnitude_dev(inp.k_raw[sel], inp.k_eff[sel], rope.layout, rd)  # [M]
    if dev_q[0] < MAG_TOL and _most(torch.ones_like(j, dtype=torch.bool), dev < MAG_TOL):
        fq, family, x = max(_fit_family(qx, qn, t, w, rd, fam) for fam in ("theta", "scale"))
        est = (
            f"theta ~ {rope.theta * x:.6g} (contract {rope.theta:.6g})"
            if family == "theta"
            else f"frequencies scaled by ~ {x:.4g}"
        )
        return _diagnosis(
            BugClass.FREQUENCY_MISMATCH,
            f"still rotations (pair magnitudes kept) but not at integer multiples "
            f"of the contract's frequencies; the query fits {est} at fit {fq:.4f}",
            q,
            bad_toks,
            a.kp,
            a.kf,
            fq,
            **base,
            family=family,
            estimate=x,
            theta_estimate=rope.theta * x if family == "theta" else None,
        )
    return _diagnosis(
        BugClass.UNKNOWN,
        "query or keys are not rotations of the reference under any tried explanation "
        f"(layouts, lengths, angle dtypes, frequencies; query pair-magnitude deviation "
        f"{float(dev_q[0]):.3g})",
        q,
        bad_toks,
        a.kp,
        a.kf,
        _wfit(a.qf, qn, a.kf[sel], kn),
        **base,
    )


def _stale_frequencies(
    inp: ForensicInput,
    a: _Analysis,
    w: torch.Tensor,
    seq_len: int,
    sel: torch.Tensor,
    base: Mapping[str, object],
    *,
    strict: bool,
) -> Diagnosis | None:
    """Length-dependent RoPE: do the keys fit the frequencies of an earlier length while the query fits
    the current ones? ``strict``: keys misfit the current frequencies outright. Otherwise (just past the
    original length, where old and new frequencies are close) the earlier length must explain the keys
    at least 5x better than the current one does."""
    rope, t = inp.rope, inp.query_position
    if not rope.length_dependent:
        return None
    j = inp.key_positions.long()[sel]
    qx, qn, kx, kn = a.qx, a.qn, a.kx[sel], a.kn[sel]
    orig = rope.scaling.original_max_position_embeddings or rope.max_position_embeddings
    lengths = list(range(orig, seq_len))
    if len(lengths) > 256:
        lengths = sorted({lengths[i] for i in torch.linspace(0, len(lengths) - 1, 256).round().long().tolist()})
    if not lengths:
        return None
    W = torch.stack([rope.inv_freq(s) for s in lengths])  # [S, n]
    fs = _fit_at(kx, kn, j.double()[:, None, None] * W[None])  # [M, S]
    cur = _fit_at(kx, kn, j.double()[:, None] * w)  # [M]
    q_cur = float(_fit_at(qx, qn, (t * w)[None])[0])
    best, idx = fs.max(dim=1)
    if strict:
        stale = (cur < FIT_OK) & (best >= FIT_OK)
        ok = q_cur >= FIT_OK and stale.any() and _most(torch.ones_like(stale), (cur >= FIT_OK) | stale)
    else:
        q_old = float(_fit_at(qx, qn, (t * W)).max()) if W.numel() else 0.0
        miss_cur, miss_best = float((1 - cur).clamp_min(0).mean()), float((1 - best).clamp_min(0).mean())
        stale = best > cur
        ok = q_cur >= FIT_OK and q_cur >= q_old - 1e-9 and miss_cur > 1e-7 and miss_best * 5 < miss_cur
    if not ok:
        return None
    s_len = _mode(torch.tensor(lengths)[idx[stale]])
    toks = [
        _tok(inp, int(sel[i]), int(j[i])) + f" with the frequencies for length {lengths[int(idx[i])]}"
        for i in _spread(torch.nonzero(stale).flatten())
    ]
    kf = torch.maximum(best, cur)
    eff, fit_all = a.kp.clone(), a.kf.clone()
    eff[sel[stale]], fit_all[sel[stale]] = j[stale], best[stale]
    return _diagnosis(
        BugClass.STALE_DYNAMIC_SCALING,
        f"keys keep the frequencies of length {s_len} while the "
        f"query uses those of length {seq_len}; they differ once the sequence passes "
        f"{orig} tokens (positions >= {orig})",
        (t, t, q_cur),
        toks,
        eff,
        fit_all,
        _wfit(q_cur, qn, kf, kn),
        **base,
        key_seq_len=s_len,
        query_seq_len=seq_len,
        first_position=orig,
    )


def _magnitude_dev(raw: torch.Tensor, eff: torch.Tensor, layout: str, rotary_dim: int) -> torch.Tensor:
    """Per token ``[N]``: mean relative deviation of ``|c_m|`` from ``A |r_m|`` (A fitted per token).
    Near 0 for any rotation (whatever its angles and attention factor); large for a mixed pairing."""
    r = _complex_pairs(raw, layout, rotary_dim).abs().flatten(1)  # [N, H*n]
    c = _complex_pairs(eff, layout, rotary_dim).abs().flatten(1)
    amp = ((r * c).sum(1) / (r * r).sum(1).clamp_min(_TINY))[:, None]  # [N, 1]
    return (c - amp * r).abs().sum(1) / (amp * r).sum(1).clamp_min(_TINY)


def _fit_family(
    qx: torch.Tensor, qn: torch.Tensor, t: int, w: torch.Tensor, rotary_dim: int, family: str
) -> tuple[float, str, float]:
    """Best query fit at position ``t`` over a 1-D family of frequencies: ``theta`` (base times x, so pair
    ``m`` scales by ``x^(-2m/rotary_dim)``) or ``scale`` (every frequency times x); x from 1/32 to 32,
    coarse (2^(1/64)) then fine (2^(1/4096)). Returns ``(fit, family, x)``."""
    expo = torch.arange(w.numel(), dtype=torch.float64) * 2 / rotary_dim  # [n]
    x = 1.0
    for grid in (2.0 ** (torch.arange(-320, 321) / 64), 2.0 ** (torch.arange(-64, 65) / 4096)):
        grid = x * grid.double()  # [G]
        W = w[None] / grid[:, None] ** expo[None] if family == "theta" else w[None] * grid[:, None]  # [G, n]
        fits = _fit_at(qx, qn, (t * W)[None])[0]  # [G]
        k = int(fits.argmax())
        x, fit = float(grid[k]), float(fits[k])
    return fit, family, x
