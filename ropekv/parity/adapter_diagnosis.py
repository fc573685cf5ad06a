"""An adapter-side diagnosis: the final logits agree, the recorded attention does not.

At the attention and forensics tiers the harness compares the attention logits it recomputes from what
the adapter *recorded* (the query, the keys and the positions it labels them with) with the float64
reference's. When every decode step's final logits agree with the reference to the level of a clean
engine while that recorded attention diverges by far more than any tolerance (often ``inf``: a key
recorded at a position the reference's mask hides), the engine cannot have attended to other keys
than the reference did, or its logits would differ too. What is wrong is the record: most often the
positions the adapter gives its keys (``arange(N)`` over a sliding window whose keys are the last
``N`` positions, slots written as positions), sometimes the query row it records. This names
:attr:`~ropekv.parity.bug_class.BugClass.MISLABELLED_KEYS` instead of blaming the kernel.

Figures used: the scale-aware errors of the report (:mod:`ropekv.parity.compare`); "clean" is at most a
tenth of the logits tolerance and "diverged" at least ten times the attention tolerance, the margins the
tolerances are calibrated with (clean engines stay 10x below, every catalogued fault goes 10x above).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ..models.config import ModelConfig
from .bug_class import BugClass
from .cases import Case
from .compare import LogitsOf, RefRow, Tolerance
from .diagnosis import Diagnosis
from .protocol import CaseRun
from .report import CaseResult

CLEAN = 0.1  # logits error at most this share of the logits tolerance: the level of a clean engine
DIVERGED = 10.0  # attention error at least this multiple of the attention tolerance


def diagnose_mislabelled_keys(
    cfg: ModelConfig,
    results: Sequence[CaseResult],
    failed: Sequence[tuple[CaseResult, CaseRun]],
    reference_row: Callable[[Case, int], RefRow],
    tol: Tolerance,
) -> Diagnosis | None:
    """:attr:`BugClass.MISLABELLED_KEYS` where every failing case of ``results`` diverged in its recorded
    attention only (final logits clean at every step, the first divergence at a layer, DIVERGED x the
    attention tolerance); None otherwise. ``failed``: failing cases with their runs (the first gives the
    evidence); ``reference_row(case, t)``: the reference's row of position ``t``."""
    bad = [r for r in results if not r.passed and r.not_applicable is None]
    if not bad or not failed:
        return None
    worst_logits = 0.0
    for r in bad:
        fd = r.first_divergence
        if fd is None or fd.layer is None or fd.attn_error is None or not fd.attn_error >= DIVERGED * tol.attn:
            return None
        errors = r.logit_errors + r.self_logit_errors
        if not errors or not all(math.isfinite(e) and e <= CLEAN * tol.logits for e in errors):
            return None
        worst_logits = max(worst_logits, *errors)
    result, run = failed[0]
    fd = result.first_divergence
    assert fd is not None and fd.layer is not None and fd.attn_error is not None  # checked above for every failing case
    case, layer, t = result.case, fd.layer, fd.query_position
    probe = run.steps[fd.step].layers[layer]
    cached = LogitsOf(cfg, case.window, case.sink_tokens).step(layer, probe, t)  # [H, N] by recorded key
    ref = reference_row(case, t).attn_logits[layer]  # [H, T] by position, -inf where hidden
    recorded = probe.key_positions.long()  # [N]
    hidden = not bool(torch.isfinite(ref[0, fd.key_position]))
    key = f"key recorded at position {fd.key_position}" + (
        ", which the reference's mask hides" if hidden else f" (reference {fd.reference_logit:.4g})"
    )
    text = (
        f"the final logits agree with the float64 reference at every decode step of the {len(bad)} failing "
        f"case(s) (worst scale-aware error {worst_logits:.2g}, tolerance {tol.logits:g}), yet the recorded "
        f"attention diverges ({case.label()}: query {t}, layer {layer}, attention error {fd.attn_error:.3g}; "
        f"{key}, cached logit {fd.cached_logit:.4g}). An engine attending to other keys than the reference "
        "could not give the same logits: the adapter's record is wrong, not the engine; most likely the "
        "keys it records (key_positions must be the logical positions of exactly the keys the query attends "
        "to: not arange(N) over a window, not slots, not keys its mask hides)"
    )
    true = _matching_positions(cached, ref, tol)
    details: dict[str, object] = {
        "case": case.label(),
        "layer": layer,
        "query_position": t,
        "max_logits_error": worst_logits,
        "attn_error": fd.attn_error if math.isfinite(fd.attn_error) else None,
        "recorded_positions": _span(recorded),
    }
    if true is not None and not torch.equal(true, recorded):
        shift = torch.unique(true - recorded)
        how = f", a constant shift of {int(shift[0]):+d}" if shift.numel() == 1 else ""
        text += (
            f"; the {recorded.numel()} recorded keys are the reference's keys at positions {_span(true)} "
            f"(recorded as {_span(recorded)}{how})"
        )
        details["matching_positions"] = _span(true)
    return Diagnosis(BugClass.MISLABELLED_KEYS, text, details)


def _matching_positions(cached: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> torch.Tensor | None:
    """The reference position ``[N]`` whose attention logits (over every head) each recorded key's match
    within the attention tolerance, or None where some key matches none (or two keys the same one)."""
    c, r = cached.double(), ref.double()  # [H, N], [H, T]
    visible = torch.isfinite(r).all(dim=0)  # [T]
    if not visible.any() or not torch.isfinite(c).all():
        return None
    cols = torch.nonzero(visible).flatten()  # [V]
    diff = (c[:, :, None] - r[:, None, cols]).abs().amax(dim=0)  # [N, V]
    best, idx = diff.min(dim=1)
    scale = max(1.0, float(r[:, cols].abs().max()))
    true = cols[idx]
    if float(best.max()) / scale > tol.attn or torch.unique(true).numel() != true.numel():
        return None
    return true


def _span(positions: torch.Tensor) -> str:
    p = positions.tolist()
    if len(p) > 1 and p == list(range(p[0], p[0] + len(p))):
        return f"{p[0]}..{p[-1]}"
    return ", ".join(map(str, p)) if len(p) <= 6 else f"{', '.join(map(str, p[:3]))}, ..., {p[-1]}"
