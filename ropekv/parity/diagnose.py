"""The diagnose stage: each failing case's evidence, then one diagnosis across all of them.

:func:`case_evidence` runs right after a failing case is judged (while its probes and its reference
forward are at hand; only the small key maps are kept): the facts of the case, and at the forensics
tier the key map of its first divergent layer (:mod:`ropekv.parity.keymap`), with the layer below's
where that layer's input already differed. :func:`diagnose` hands every case's evidence to the
explanations (:mod:`ropekv.parity.explain.combine`), in the order the check was given them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..contract import DTYPES
from ..models.config import ModelConfig
from ..models.reference import ReferenceOutput
from ..probe import LayerProbe
from .cases import Case, OpKind
from .compare import LogitsOf, RefRow, Tolerance, tolerance_for
from .diagnosis import Diagnosis
from .explain.combine import diagnose_cases
from .explain.evidence import CaseEvidence, Explanation
from .explain.facts import CaseFacts, ModelFacts
from .keymap.fit import FitInput, Geometry, fit_keymap
from .keymap.record import NOISE, KeyMap
from .protocol import CaseRun, Tier
from .report import CaseResult


@dataclass(frozen=True)
class EngineFacts:
    """What the diagnosis needs to know of the engine: its key form, dtype and KV dtype."""

    key_form: str | None
    dtype: torch.dtype
    kv_dtype: str | None = None


def model_facts(cfg: ModelConfig) -> ModelFacts:
    return ModelFacts(
        layer_ropes=tuple(cfg.layer_rope(i) for i in range(cfg.num_layers)),
        layer_attentions=tuple(cfg.layer_attentions),
        has_mla=cfg.mla is not None,
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return next((k for k, v in DTYPES.items() if v == dtype and k in NOISE), "float32")


def noise_for(engine: EngineFacts, tol: Tolerance) -> float:
    """The residual a cell may keep and still count as exact: the engine dtype's
    (:data:`~ropekv.parity.keymap.record.NOISE`), an 8-bit KV cache's, or, under a tolerance wider than
    the dtype's own (quantized weights), 0.4 of its attention tolerance."""
    noise = NOISE[_dtype_name(engine.dtype)]
    if engine.kv_dtype is not None:
        noise = max(noise, NOISE["fp8"])
    own = tolerance_for(engine.dtype)
    if tol.attn > own.attn:
        noise = max(noise, 0.4 * tol.attn)
    return noise


def operation_offsets(case: Case) -> tuple[int, ...]:
    """Constant offsets a case's operation makes worth trying (its bugs' offsets)."""
    op = case.op
    if op is None:
        return ()
    n = case.prefix + case.length
    if op.kind == OpKind.ROLLBACK:
        return (op.amount,)
    if op.kind == OpKind.EVICT:
        return (-op.amount,)
    if op.kind == OpKind.SHIFT:
        return (-op.amount, op.amount)
    if op.kind == OpKind.BATCH:
        lengths = case.batch_lengths
        return tuple(sorted({max(lengths) - x for x in lengths} - {0}))
    if op.kind == OpKind.RESTORE:
        return (-n,)
    k, m = op.amount, case.spec_accepted
    return (1, -1, k - m, k - 1 - m)


def _role(case: Case, step: int) -> str:
    records = case.spec_records
    return records[step][0] if records and 0 <= step < len(records) else "decode"


def _layer_window(case: Case, cfg: ModelConfig, layer: int) -> tuple[int | None, int | None]:
    """The layer's window and attention chunk under the case (a case window replaces both)."""
    if case.window is not None:
        return case.window, None
    return cfg.layer_window(layer), cfg.layer_chunk(layer)


def layer_keymap(
    cfg: ModelConfig,
    case: Case,
    layer: int,
    view: LayerProbe,
    reference: LayerProbe,
    row: int,
    visible: torch.Tensor,
    t: int,
    noise: float,
    origin: int = 0,
) -> KeyMap | None:
    """The key map of ``layer`` at the decode row ``t`` of ``case``: ``view`` the engine's probe
    (``q [1, H, D]``, the keys it read), ``reference`` the float64 forward's (raw rows by token index,
    the row's query at ``row``), ``visible [T]`` the reference's mask by position from ``origin``
    (:attr:`RefRow.origin`). None where the reference records no raw query and keys."""
    if reference.q_raw is None or reference.k_raw is None:
        return None
    window, _ = _layer_window(case, cfg, layer)
    slots = view.key_slots if view.key_slots is not None else torch.full_like(view.key_positions, -1)
    return fit_keymap(
        FitInput(
            layer=layer,
            rope=cfg.layer_rope(layer),
            others=model_facts(cfg).others(layer),
            seq_len=t + 1,
            query_position=t,
            q_raw=reference.q_raw[row],
            q_eff=view.q[0],
            ref_keys=reference.k_raw,
            k_eff=view.k,
            key_positions=view.key_positions,
            key_slots=slots,
            visible=visible,
            noise=noise,
            shift=case.shift,
            origin=origin,
            ref_values=reference.v,
            v_eff=view.v,
            streams=case.position_streams(),
            geometry=Geometry(
                prefix=case.prefix,
                block_size=case.block_size,
                window=window,
                sinks=case.sink_tokens,
                offsets=operation_offsets(case),
            ),
        )
    )


def case_evidence(
    cfg: ModelConfig,
    result: CaseResult,
    run: CaseRun,
    *,
    tier: Tier,
    engine: EngineFacts,
    tol: Tolerance,
    reference: ReferenceOutput | None,
    reference_row: int,
    ref_row: RefRow | None,
) -> CaseEvidence:
    """One failing case's evidence (``reference``: the float64 forward its divergence row is row
    ``reference_row`` of; ``ref_row``: that row's attention by position from its origin)."""
    fd = result.first_divergence
    case = result.case
    mf = model_facts(cfg)
    assert fd is not None
    layer = fd.layer
    window, chunk = (None, None) if layer is None else _layer_window(case, cfg, layer)
    facts = CaseFacts(
        case=case,
        model=mf,
        divergence=fd,
        layer=layer,
        query_position=fd.query_position,
        step=fd.step,
        role=_role(case, fd.step),
        window=window,
        chunk_size=chunk,
        handoff_len=run.handoff_len,
        key_form=engine.key_form,
        engine_dtype=_dtype_name(engine.dtype),
        kv_dtype=engine.kv_dtype,
        self_passed=result.self_passed,
        input_matched=fd.input_matched,
        logit_errors=result.logit_errors,
        self_logit_errors=result.self_logit_errors,
        attn_error=fd.attn_error,
        tolerance_attn=tol.attn,
        tolerance_logits=tol.logits,
    )
    if layer is None or tier < Tier.ATTENTION or ref_row is None:
        return CaseEvidence(facts)
    view = run.steps[fd.step].layers[layer]
    of = LogitsOf(cfg, case.window, case.sink_tokens)
    cached_attn = of.step(layer, view, fd.query_position)
    ref_attn = ref_row.attn_logits[layer]
    km = below = None
    if tier >= Tier.FORENSICS and reference is not None:
        noise = noise_for(engine, tol)
        t = fd.query_position
        km = layer_keymap(
            cfg,
            case,
            layer,
            view,
            reference.layers[layer],
            reference_row,
            torch.isfinite(ref_attn[0]),
            t,
            noise,
            ref_row.origin,
        )
        if fd.input_matched is False and layer > 0:
            below = layer_keymap(
                cfg,
                case,
                layer - 1,
                run.steps[fd.step].layers[layer - 1],
                reference.layers[layer - 1],
                reference_row,
                torch.isfinite(ref_row.attn_logits[layer - 1][0]),
                t,
                noise,
                ref_row.origin,
            )
    return CaseEvidence(
        facts,
        keymap=km,
        below=below,
        cached_attention=cached_attn,
        reference_attention=ref_attn,
        reference_origin=ref_row.origin,
        recorded_positions=view.key_positions.long(),
        keys_seen=view.k.detach().cpu(),
    )


def diagnose(
    evidences: Sequence[CaseEvidence], explanations: Sequence[Explanation], passing: Sequence[Case]
) -> Diagnosis:
    """One diagnosis across the failing cases' ``evidences`` (:mod:`ropekv.parity.explain.combine`)."""
    return diagnose_cases(evidences, explanations, passing)
