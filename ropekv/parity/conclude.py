"""The report stage: the verdict, what the engine's tier cannot conclude, and the ParityReport."""

from __future__ import annotations

import time

from .applicable import Applicability
from .bug_class import BugClass
from .diagnosis import Diagnosis
from .plan import CheckPlan, describe, refuse_nothing_judged
from .protocol import Tier
from .provenance import provenance
from .references import References
from .report import CaseResult, ParityReport, plural


def tier_limits(tier: Tier, results: list[CaseResult], diagnosis: Diagnosis | None = None) -> str:
    """What the tier the engine ran at cannot conclude, in one sentence for the report. ``diagnosis``:
    the one the check named (an attention-tier check can still name an adapter-side bug: its recorded
    attention against its own clean logits)."""
    failing = [(r, r.first_divergence) for r in results if r.first_divergence is not None]
    if tier == Tier.LOGITS:
        if not failing:
            return (
                "logits tier: next-token logits match; a fault that leaves the logits within tolerance "
                "(or shows only in layers the logits hide) is not excluded; layer and bug class not examined"
            )
        first, fd = failing[0]
        assert fd is not None
        return (
            f"logits tier: divergence localized to decode step {fd.step} (position {fd.query_position}) "
            f"of {first.case.label()}; layer and bug class unknown"
        )
    if tier == Tier.ATTENTION:
        if failing and diagnosis is not None and diagnosis.kind == BugClass.MISLABELLED_KEYS:
            return (
                "attention tier: first divergent layer localized; the record, not the engine, is named "
                "(clean logits, divergent recorded attention); engine-side bug classes not examined"
            )
        return (
            (
                "attention tier: first divergent layer localized; bug class not named (the adapter does not "
                "promise the exact query and keys its kernel multiplied)"
            )
            if failing
            else "attention tier: every layer's attention logits match; bug class not examined"
        )
    return "forensics tier: all conclusions available"


def conclude(
    plan: CheckPlan, results: list[CaseResult], diagnosis: Diagnosis | None, refs: References, started: float
) -> ParityReport:
    """The report of a check: n/a cases are left out of the verdict; nothing judged is refused."""
    refuse_nothing_judged([Applicability(r.case, (), r.not_applicable) for r in results])
    from ..models.default import display_name  # local: the default-model module pulls in the GGUF reader

    adapter, cfg = plan.adapter, plan.cfg
    ckpt = adapter.checkpoint
    request = plan.request
    return ParityReport(
        passed=all(r.passed for r in results if r.not_applicable is None),
        model={
            "name": display_name(ckpt),
            "config_name": cfg.name,
            "architecture": cfg.architecture,
            "warnings": list(cfg.warnings),
            "fingerprint": ckpt.fingerprint,
            "source": ckpt.source,
            "rope": cfg.rope.to_dict(),
            "rope_fingerprint": cfg.rope.fingerprint(),
        },
        engine=describe(adapter).to_dict(),
        reference=request.reference,
        tier=plan.tier.value,
        limits=tier_limits(plan.tier, results, diagnosis),
        tolerances={"reference": plan.tol_reference.to_dict(), "self": plan.tol_self.to_dict()},
        cases=tuple(results),
        diagnosis=diagnosis,
        seconds=time.perf_counter() - started,
        seed=request.seed,
        phase_seconds=dict(refs.seconds),
        reference_cache=None if plan.store is None else refs.cache_summary(),
        provenance=provenance(
            f"ropekv.check({adapter.name!r}, {plural(len(results), 'case')}, seed={request.seed}, "
            f"reference={request.reference!r})"
        ),
    )
