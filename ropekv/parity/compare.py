"""Layer-by-layer comparison of one decode step with a reference row, and the tolerances.

Errors are scale-aware: ``max |cached - ref| / max(1, max |ref|)`` over the entries both sides see.
A key visible on one side and masked on the other is an infinite error (a window or mask bug).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..adapters.base import StepTrace


@dataclass(frozen=True)
class Tolerance:
    """Largest scale-aware error that still counts as parity, per compared quantity."""

    attn: float
    hidden: float
    logits: float

    def to_dict(self) -> dict:
        return {"attn_logits": self.attn, "hidden_in": self.hidden, "final_logits": self.logits}


# Calibrated on SmolLM2-135M and the tiny test models: clean engines stay at least 10x below these,
# every catalogued fault goes at least 10x above (docs/report.md has the measured figures).
_TOLERANCES = {
    torch.float64: Tolerance(attn=1e-6, hidden=1e-6, logits=1e-6),
    torch.float32: Tolerance(attn=2e-3, hidden=2e-3, logits=5e-3),
    torch.float16: Tolerance(attn=6e-2, hidden=6e-2, logits=1e-1),
    torch.bfloat16: Tolerance(attn=1.5e-1, hidden=1.5e-1, logits=2.5e-1),
}


def tolerance_for(engine_dtype: torch.dtype, reference_dtype: torch.dtype = torch.float64) -> Tolerance:
    """The tolerance set by the coarser of the two dtypes in play."""
    order = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
    coarser = max(engine_dtype, reference_dtype, key=order.index)
    return _TOLERANCES[coarser]


def scaled_error(cached: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |cached - ref| / max(1, max |ref|)`` over finite entries; inf if the masks differ."""
    cached = cached.double()
    ref = ref.double()
    fin_c, fin_r = torch.isfinite(cached), torch.isfinite(ref)
    if not torch.equal(fin_c, fin_r):
        return math.inf
    if not fin_r.any():
        return 0.0
    diff = (cached[fin_r] - ref[fin_r]).abs().max().item()
    return diff / max(1.0, ref[fin_r].abs().max().item())


@dataclass(frozen=True)
class StepErrors:
    """Errors of one decode step against one reference, per layer."""

    position: int
    attn: tuple[float, ...]  # per layer
    hidden: tuple[float, ...]  # per layer (the layer's input)
    logits: float  # final logits, scale-aware
    max_abs_logit_diff: float  # final logits, absolute


@dataclass(frozen=True)
class RefRow:
    """One reference row ``t``: per layer its input and its attention logits over all keys."""

    hidden_in: tuple[torch.Tensor, ...]  # per layer [hidden]
    attn_logits: tuple[torch.Tensor, ...]  # per layer [H, T]
    logits: torch.Tensor  # [vocab]


def compare_step(step: StepTrace, ref: RefRow) -> StepErrors:
    attn, hidden = [], []
    for layer, view in enumerate(step.layers):
        ref_attn = ref.attn_logits[layer][:, view.key_positions]  # [H, N]
        attn.append(scaled_error(view.attn_logits, ref_attn))
        if _mask_misses_keys(ref.attn_logits[layer], view.key_positions):
            attn[-1] = math.inf
        hidden.append(scaled_error(view.hidden_in, ref.hidden_in[layer]))
    logits_err = scaled_error(step.logits, ref.logits)
    abs_diff = (step.logits.double() - ref.logits.double()).abs().max().item()
    return StepErrors(step.position, tuple(attn), tuple(hidden), logits_err, abs_diff)


def _mask_misses_keys(ref_row: torch.Tensor, key_positions: torch.Tensor) -> bool:
    """True if the reference sees a key the engine did not read at all."""
    visible = torch.isfinite(ref_row[0]).nonzero().flatten()
    return not bool(torch.isin(visible, key_positions).all())


def first_failure(errors: list[StepErrors], tol: Tolerance) -> tuple[int, int] | None:
    """``(step index, layer)`` of the first diverging attention logits (or input), in decode order."""
    for s, e in enumerate(errors):
        for layer, (a, h) in enumerate(zip(e.attn, e.hidden)):
            if a > tol.attn or h > tol.hidden:
                return s, layer
        if e.logits > tol.logits:
            return s, len(e.attn) - 1
    return None


def worst_entry(cached: torch.Tensor, ref: torch.Tensor) -> tuple[int, int, float, float]:
    """``(head, key index, cached value, reference value)`` of the largest logit difference ``[H, N]``."""
    c, r = cached.double(), ref.double()
    diff = (c - r).abs()
    both_inf = ~torch.isfinite(c) & ~torch.isfinite(r)
    diff = torch.where(both_inf, torch.zeros_like(diff), diff)
    diff = torch.nan_to_num(diff, nan=math.inf, posinf=math.inf)
    flat = int(torch.argmax(diff))
    head, key = divmod(flat, diff.shape[1])
    return head, key, float(c[head, key]), float(r[head, key])
