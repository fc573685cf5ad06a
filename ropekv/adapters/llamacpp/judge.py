"""A parity verdict under the engine's own tolerance (the minimum the harness does not do yet).

``ropekv.check`` takes its tolerance from the adapter's compute dtype. A Q4_1 llama.cpp run computes
in float32, but its noise floor is set by ggml's 8-bit activation blocks (module
:mod:`.tolerance`), far above float32's: under the float32 tolerance every Q4_1 case fails, which says
nothing about RoPE. :func:`judge` re-reads a report's per-step, per-layer errors (both against the
float64 reference and against the engine's own full forward) under ``engine.tolerance``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...parity.compare import Tolerance
from ...parity.report import ParityReport


@dataclass(frozen=True)
class Verdict:
    passed: bool
    failures: tuple[str, ...]  # "L=17 P=0 ...: step 0 layer 12 attention 0.31 > 0.2 (reference)"
    tolerance: Tolerance


def judge(report: ParityReport, tolerance: Tolerance) -> Verdict:
    failures = []
    for r in report.cases:
        for against, attn, logits in (
            ("reference", r.attn_errors, r.logit_errors),
            ("self", r.self_attn_errors, r.self_logit_errors),
        ):
            for s, per_layer in enumerate(attn):
                bad = [(i, e) for i, e in enumerate(per_layer) if e > tolerance.attn]
                if bad:
                    i, e = bad[0]
                    failures.append(
                        f"{r.case.label()}: step {s} layer {i} attention {e:.3g} > {tolerance.attn} ({against})"
                    )
                    break
            for s, e in enumerate(logits):
                if e > tolerance.logits:
                    failures.append(f"{r.case.label()}: step {s} logits {e:.3g} > {tolerance.logits} ({against})")
                    break
    return Verdict(passed=not failures, failures=tuple(failures), tolerance=tolerance)
