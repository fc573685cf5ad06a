"""An engine seen at a lower adapter tier: what a logits-tier or attention-tier adapter would report.

``at_tier(adapter, Tier.LOGITS)`` drops the per-layer records (the harness then compares next-token
logits only); ``at_tier(adapter, Tier.ATTENTION)`` keeps them but declares the attention tier, so
the harness localizes the first divergent layer without naming a bug class. The tests use it to
prove each catalogued fault is caught at every tier, not only named at the forensics tier.
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import UsageError
from ..parity.cases import Case
from ..parity.protocol import CaseRun, EngineDescription, FullRun, Ignored, Tier


class TierView:
    """Delegates to ``inner``, reporting only what an adapter of ``tier`` reports."""

    def __init__(self, inner, tier: Tier) -> None:
        if not isinstance(tier, Tier) or inner.tier < tier:
            raise UsageError(f"at_tier: {tier!r} is not a tier at or below the adapter's ({inner.tier})")
        self.inner, self.tier = inner, tier
        self.checkpoint, self.dtype = inner.checkpoint, inner.dtype
        self.name = f"{inner.name} (seen at the {tier.value} tier)"

    def describe(self) -> EngineDescription:
        d = self.inner.describe()
        return dataclasses.replace(d, name=f"{d.name} (seen at the {self.tier.value} tier)")

    def ignored(self, case: Case) -> tuple[Ignored, ...]:
        return tuple(self.inner.ignored(case))

    def run_case(self, case: Case, tokens: torch.Tensor) -> CaseRun:
        run = self.inner.run_case(case, tokens)
        if self.tier != Tier.LOGITS:
            return run
        return dataclasses.replace(run, steps=tuple(dataclasses.replace(s, layers=()) for s in run.steps))

    def full_forward(self, tokens: torch.Tensor, rows: list[int], case: Case) -> FullRun:
        run = self.inner.full_forward(tokens, rows, case)
        return run if self.tier != Tier.LOGITS else dataclasses.replace(run, layers=())


def at_tier(adapter, tier: Tier) -> TierView:
    """``adapter`` as an adapter of the lower (or equal) ``tier`` would report it."""
    return TierView(adapter, tier)
