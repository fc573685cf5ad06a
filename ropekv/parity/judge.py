"""The judge stage: a case's decode steps against both references, layer by layer, and its verdict.

Each step's per-layer inputs and attention logits (and the final logits) are compared with the
float64 reference's row and with the engine's own cache-free forward (:mod:`ropekv.parity.compare`);
the first failure against the reference (else against the engine itself) is the case's
:class:`~ropekv.parity.report.Divergence`, with the key it names and why: a key the kernel read that
the reference hides, or one the reference shows that the kernel did not read, is named as such.
A failing case's evidence for the diagnosis is taken here, while its probes and reference are at hand.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from . import ops
from .cases import Case, slide_note
from .compare import (
    LogitsOf,
    NextToken,
    RefRow,
    StepErrors,
    Tolerance,
    compare_step,
    first_failure,
    logits_error,
    scaled_error,
    worst_entry,
)
from .diagnose import EngineFacts, case_evidence
from .explain.evidence import CaseEvidence
from .plan import CheckPlan
from .protocol import CaseRun, StepRecord, Tier
from .references import References
from .report import CaseResult, Divergence


@dataclass(frozen=True, eq=False)
class Judged:
    result: CaseResult
    evidence: CaseEvidence | None  # failing cases at the attention tier and above


def judge(
    plan: CheckPlan,
    refs: References,
    case: Case,
    run: CaseRun,
    notes: tuple[str, ...],
    ran_seconds: float,
    engine: EngineFacts,
) -> Judged:
    """Compare ``run`` with both references; the case's result and, where it failed, its evidence."""
    t0 = time.perf_counter()
    cfg = plan.cfg
    refs.prepare(case)
    ref_rows = [refs.reference_row(case, s.position) for s in run.steps]
    of = LogitsOf(cfg, case.window, case.sink_tokens)
    err_ref = [compare_step(s.layers, _next(s), s.position, r, of) for s, r in zip(run.steps, ref_rows)]
    fail_ref = first_failure(err_ref, plan.tol_reference)
    kept = None  # the reference forward of a failing row, held for the evidence before it is released
    if fail_ref is not None and plan.tier >= Tier.FORENSICS:
        kept = refs.reference_output(case, run.steps[fail_ref[0]].position)
    refs.done_with_reference(case)  # its probes go before the engine's full forward, if no case reads them
    self_rows = [refs.self_row(case, s.position) for s in run.steps]
    err_self = [compare_step(s.layers, _next(s), s.position, r, of) for s, r in zip(run.steps, self_rows)]
    # Cross-engine parity (no cache) is a property of plain rows; an operation's self rows are
    # relabelled or borrowed from the reference (ops.py), so they say nothing about it.
    full_err = max(_rows_error(a, b) for a, b in zip(self_rows, ref_rows)) if case.op is None else None
    fail_self = first_failure(err_self, plan.tol_self)
    divergence = None
    if fail_ref is not None:
        divergence = _divergence("reference", fail_ref, run, ref_rows, err_ref, plan.tol_reference, of)
    elif fail_self is not None:
        divergence = _divergence("self", fail_self, run, self_rows, err_self, plan.tol_self, of)
    result = CaseResult(
        case=case,
        passed=fail_ref is None and fail_self is None,
        reference_passed=fail_ref is None,
        self_passed=fail_self is None,
        max_abs_logit_diff=max(e.max_abs_logit_diff for e in err_ref),
        max_attn_error=_max(err_ref),
        max_self_attn_error=_max(err_self),
        first_divergence=divergence,
        positions=tuple(s.position for s in run.steps),
        attn_errors=tuple(e.attn for e in err_ref),
        self_attn_errors=tuple(e.attn for e in err_self),
        logit_errors=tuple(e.logits for e in err_ref),
        self_logit_errors=tuple(e.logits for e in err_self),
        ignored=notes,
        notes=run.notes
        + ops.notes(case)
        + tuple(n for n in [slide_note(case, cfg.layer_attentions), refs.notes.get(case)] if n),
        full_forward_error=full_err,
        seconds=ran_seconds + time.perf_counter() - t0,
        reference_source=refs.sources.get(case),
    )
    evidence = None
    if divergence is not None and plan.tier >= Tier.ATTENTION:
        t = divergence.query_position
        if kept is None and plan.tier >= Tier.FORENSICS:
            kept = refs.reference_output(case, t)  # diverged against itself only: the reference again
        rows = (
            ref_rows if divergence.against == "reference" else [refs.reference_row(case, s.position) for s in run.steps]
        )
        evidence = case_evidence(
            cfg,
            result,
            run,
            tier=plan.tier,
            engine=engine,
            tol=plan.tol_reference if divergence.against == "reference" else plan.tol_self,
            reference=None if kept is None else kept[0],
            reference_row=0 if kept is None else kept[1],
            ref_row=rows[divergence.step],
        )
    return Judged(result, evidence)


def _next(step: StepRecord) -> NextToken:
    return NextToken(step.logits, step.token_ids)


def _rows_error(engine_row: RefRow, ref_row: RefRow) -> float:
    """Cross-engine parity without any cache: the engine's own full forward against the float64
    reference at the same row, worst over layers (attention logits) and the final logits."""
    errs = [scaled_error(a, b) for a, b in zip(engine_row.attn_logits, ref_row.attn_logits)]
    return max(errs + [logits_error(engine_row.logits, ref_row.logits)[0]])


def _max(errors: list[StepErrors]) -> float | None:
    if not any(e.attn for e in errors):
        return None
    return max(max(e.attn) for e in errors)


def _divergence(
    against: str,
    where: tuple[int, int | None],
    run: CaseRun,
    rows: list[RefRow],
    errors: list[StepErrors],
    tol: Tolerance,
    of: LogitsOf,
) -> Divergence:
    s, layer = where
    step = run.steps[s]
    if layer is None:  # logits tier: only the final logits are known
        return Divergence(
            against=against,
            step=s,
            query_position=step.position,
            layer=None,
            head=None,
            key_position=None,
            key_slot=None,
            reference_logit=None,
            cached_logit=None,
            attn_error=None,
            input_error=None,
            input_matched=None,
            logits_error=errors[s].logits,
        )
    probe = step.layers[layer]
    cached_attn = of.step(layer, probe, step.position)  # [H, N]
    ref = rows[s]
    input_err = errors[s].hidden[layer]
    reason = None
    pos = probe.key_positions.long()
    ref_attn = ref.at(layer, pos)  # [H, N], -inf at a key the reference's query does not see
    hidden_read = torch.nonzero(~torch.isfinite(ref_attn[0])).flatten()
    visible = ref.visible(layer)  # [K] positions
    missed = visible[~torch.isin(visible, pos)]
    if missed.numel():  # a key the query should see that the kernel never read: name it, not a read key
        key = int(missed[0])
        ref_key = ref.at(layer, missed[:1])[:, 0]  # [H]
        head = int(ref_key.abs().argmax())
        reason = f"key {key} is visible to the query but the kernel did not read it ({missed.numel()} such key(s))"
        return Divergence(
            against=against,
            step=s,
            query_position=step.position,
            layer=layer,
            head=head,
            key_position=key,
            key_slot=-1,
            reference_logit=float(ref_key[head]),
            cached_logit=-math.inf,
            attn_error=errors[s].attn[layer],
            input_error=input_err,
            input_matched=input_err <= tol.hidden,
            logits_error=errors[s].logits,
            reason=reason,
        )
    head, k, cached, refv = worst_entry(cached_attn, ref_attn.to(cached_attn.dtype))
    if hidden_read.numel() and k in hidden_read.tolist():
        reason = f"key {int(pos[k])} was read by the kernel but the reference's mask hides it"
    slot = -1 if probe.key_slots is None else int(probe.key_slots[k])
    return Divergence(
        against=against,
        step=s,
        query_position=step.position,
        layer=layer,
        head=head,
        key_position=int(pos[k]),
        key_slot=slot,
        reference_logit=refv,
        cached_logit=cached,
        attn_error=errors[s].attn[layer],
        input_error=input_err,
        input_matched=input_err <= tol.hidden,
        logits_error=errors[s].logits,
        reason=reason,
    )
