"""mislabelled_keys: the final logits agree, the recorded attention does not: the adapter's record is wrong.

At the attention and forensics tiers ropekv recomputes attention from what the adapter recorded (the
query, the keys, the positions it labels them with). When every decode step's final logits agree with
the float64 reference to the level of a clean engine while that recorded attention diverges far past
any tolerance, the engine cannot have attended to other keys, or its logits would differ too: the
record is wrong (most often its key positions: ``arange(N)`` over a window, slots written as positions).
"Clean" is a tenth of the logits tolerance, "diverged" ten times the attention tolerance: the margins
the tolerances are calibrated with.
"""

from __future__ import annotations

import math

import torch

from ..faults.native import NativeFault
from ..parity.bug_class import BugClass
from ..parity.compare import columns
from ..parity.explain.cells import span_text
from ..parity.explain.evidence import CaseEvidence, Explanation, Match

KIND = BugClass.MISLABELLED_KEYS
CLEAN = 0.1
DIVERGED = 10.0


def explain(ev: CaseEvidence) -> Match | None:
    f = ev.facts
    if f.layer is None or f.attn_error is None or not f.attn_error >= DIVERGED * f.tolerance_attn:
        return None
    errors = f.logit_errors + f.self_logit_errors
    if not errors or not all(math.isfinite(e) and e <= CLEAN * f.tolerance_logits for e in errors):
        return None
    fd = f.divergence
    hidden = False
    if ev.reference_attention is not None and fd.key_position is not None:
        at = columns(ev.reference_attention, ev.reference_origin, torch.tensor([fd.key_position]))  # [H, 1]
        hidden = not bool(torch.isfinite(at[0, 0]))
    key = f"key recorded at position {fd.key_position}" + (
        ", which the reference's mask hides" if hidden else f" (reference {fd.reference_logit:.4g})"
    )
    worst = max(errors)
    text = (
        f"the final logits agree with the float64 reference at every decode step (worst scale-aware error "
        f"{worst:.2g}, tolerance {f.tolerance_logits:g}), yet the recorded attention diverges ({f.case.label()}: "
        f"query {f.query_position}, layer {f.layer}, attention error {f.attn_error:.3g}; {key}, cached logit "
        f"{fd.cached_logit:.4g}). An engine attending to other keys than the reference could not give the same "
        "logits: the adapter's record is wrong, not the engine; most likely the keys it records (key_positions "
        "must be the logical positions of exactly the keys the query attends to: not arange(N) over a window, "
        "not slots, not keys its mask hides)"
    )
    details: dict[str, object] = {"max_logits_error": worst}
    true = _matching_positions(ev)
    rec = ev.recorded_positions
    if true is not None and rec is not None and not torch.equal(true, rec):
        shift = torch.unique(true - rec)
        how = f", a constant shift of {int(shift[0]):+d}" if shift.numel() == 1 else ""
        text += (
            f"; the {rec.numel()} recorded keys are the reference's keys at positions {span_text(true.tolist())} "
            f"(recorded as {span_text(rec.tolist())}{how})"
        )
        details["matching_positions"] = span_text(true.tolist())
    return Match(KIND, 1.0, text, "all", details)


def _matching_positions(ev: CaseEvidence) -> torch.Tensor | None:
    """The reference position whose attention logits (over every head) each recorded key's match, or
    None where some key matches none (one position each, the nearest)."""
    cached, ref = ev.cached_attention, ev.reference_attention
    if cached is None or ref is None:
        return None
    tol = ev.facts.tolerance_attn
    c, r = cached.double(), ref.double()  # [H, N], [H, T]
    ok = torch.isfinite(r).all(0)
    if not bool(ok.any()):
        return None
    scale = max(1.0, float(r[:, ok].abs().max()))
    d = (c[:, :, None] - torch.where(ok, r, torch.zeros_like(r))[:, None, :]).abs().amax(0) / scale  # [N, T]
    d[:, ~ok] = math.inf
    best, idx = d.min(dim=1)
    if not bool((best <= 10 * tol).all()):
        return None
    return idx + ev.reference_origin


EXPLANATION = Explanation(KIND, explain)


FAULTS: tuple[NativeFault, ...] = ()  # no catalogued fault of ropekv's engine shows this class alone
