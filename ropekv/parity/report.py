"""The parity report: what ``ropekv check`` returns, prints and writes as JSON (docs/report.md)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from .cases import Case
from .diagnosis import Diagnosis

REPORT_FORMAT = "ropekv.parity-report"
REPORT_VERSION = 2  # 2: tier, limits, provenance, logit_errors, notes; nullable layer fields


@dataclass(frozen=True)
class Divergence:
    """Where a cached run first left a reference."""

    against: str  # "reference" (float64 decoder) or "self" (the engine's own full forward)
    step: int  # decode step index
    query_position: int
    layer: int | None  # None at the logits tier: only the final logits are known
    head: int | None
    key_position: int | None
    key_slot: int | None
    reference_logit: float | None
    cached_logit: float | None
    attn_error: float | None  # scale-aware error of the layer's attention logits
    input_error: float | None  # scale-aware error of the layer's input hidden state
    input_matched: bool | None
    logits_error: float = 0.0  # scale-aware error of the step's next-token logits

    def describe(self) -> str:
        if self.layer is None:
            return (
                f"vs {self.against}: decode step {self.step} (query position {self.query_position}): next-token "
                f"logits error {self.logits_error:.3g} (logits tier: no layer information)"
            )
        where = "input matched" if self.input_matched else "input already differed"
        return (
            f"vs {self.against}: decode step {self.step} (query position {self.query_position}), layer "
            f"{self.layer} ({where}), head {self.head}, key position {self.key_position} (slot {self.key_slot}): "
            f"reference {self.reference_logit:.4g}, cached {self.cached_logit:.4g}"
        )

    def short(self) -> str:
        if self.layer is None:
            return f"{self.against}: step {self.step} pos {self.query_position} (logits)"
        return (
            f"{self.against}: step {self.step} pos {self.query_position} layer {self.layer} "
            f"head {self.head} key {self.key_position} (slot {self.key_slot})"
        )


@dataclass(frozen=True)
class CaseResult:
    case: Case
    passed: bool
    reference_passed: bool
    self_passed: bool
    max_abs_logit_diff: float  # final logits against the reference
    max_attn_error: float | None  # worst attention-logit error against the reference (None: logits tier)
    max_self_attn_error: float | None
    first_divergence: Divergence | None
    positions: tuple[int, ...]  # decode positions
    attn_errors: tuple[tuple[float, ...], ...]  # [step][layer] against the reference (empty rows: logits tier)
    self_attn_errors: tuple[tuple[float, ...], ...]  # [step][layer] against the engine itself
    logit_errors: tuple[float, ...] = ()  # [step] next-token logits against the reference
    self_logit_errors: tuple[float, ...] = ()  # [step] against the engine's own full forward
    ignored: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # engine facts (prefix-cache hits, ...)
    full_forward_error: float | None = 0.0  # the engine's cache-free forward vs float64 (None: an op case)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": self.case.to_dict(),
            "label": self.case.label(),
            "passed": self.passed,
            "reference_passed": self.reference_passed,
            "self_passed": self.self_passed,
            "max_abs_logit_diff": _num(self.max_abs_logit_diff),
            "max_attn_error": _num(self.max_attn_error),
            "max_self_attn_error": _num(self.max_self_attn_error),
            "first_divergence": None
            if self.first_divergence is None
            else {k: _num(v) for k, v in vars(self.first_divergence).items()},
            "positions": list(self.positions),
            "attn_errors": [[_num(x) for x in row] for row in self.attn_errors],
            "self_attn_errors": [[_num(x) for x in row] for row in self.self_attn_errors],
            "logit_errors": [_num(x) for x in self.logit_errors],
            "self_logit_errors": [_num(x) for x in self.self_logit_errors],
            "ignored": list(self.ignored),
            "notes": list(self.notes),
            "full_forward_error": _num(self.full_forward_error),
            "seconds": round(self.seconds, 3),
        }


@dataclass(frozen=True)
class ParityReport:
    passed: bool
    model: dict[str, Any]
    engine: dict[str, Any]
    reference: str
    tolerances: dict[str, dict[str, float]]  # "reference"/"self" -> Tolerance.to_dict()
    cases: tuple[CaseResult, ...]
    diagnosis: Diagnosis | None
    seconds: float
    seed: int = 0
    tier: str = "forensics"  # the tier the engine ran at (ropekv.parity.protocol.Tier)
    limits: str = ""  # what that tier cannot conclude
    provenance: dict[str, Any] = field(default_factory=dict)  # versions, machine, call, time (see provenance())
    # wall seconds of the check's unavoidable parts: float64 reference forwards, the engine's own
    # full forwards (self-parity) and the cached runs; the rest of ``seconds`` is the harness itself
    phase_seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": REPORT_FORMAT,
            "version": REPORT_VERSION,
            "passed": self.passed,
            "model": self.model,
            "engine": self.engine,
            "tier": self.tier,
            "limits": self.limits,
            "reference": self.reference,
            "tolerances": self.tolerances,
            "seed": self.seed,
            "seconds": round(self.seconds, 2),
            "cases": [c.to_dict() for c in self.cases],
            "diagnosis": None if self.diagnosis is None else self.diagnosis.to_dict(),
            "provenance": self.provenance,
            "phase_seconds": {k: round(v, 3) for k, v in self.phase_seconds.items()},
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def table(self) -> str:
        """Plain-text table of cases, then the verdict and diagnosis."""
        w = max([34] + [len(r.case.label()) for r in self.cases])  # the case column fits the longest label
        header = f"{'case':<{w}} {'result':<7} {'max|dlogit|':>11} {'attn err':>9} {'self err':>9}  first divergence"
        lines = [f"warning: {w}" for w in self.model.get("warnings", ())]
        lines += [header, "-" * len(header)]
        for r in self.cases:
            fd = r.first_divergence
            where = "-" if fd is None else fd.short()
            lines.append(
                f"{r.case.label():<{w}} {'PASS' if r.passed else 'FAIL':<7} {r.max_abs_logit_diff:>11.2e} "
                f"{_fmt(r.max_attn_error):>9} {_fmt(r.max_self_attn_error):>9}  {where}"
            )
            if r.ignored:
                lines.append(f"{'':<{w}} note: ignored for this engine: {', '.join(r.ignored)}")
            for note in r.notes:
                lines.append(f"{'':<{w}} note: {note}")
        n_fail = sum(not r.passed for r in self.cases)
        worst_full = max((r.full_forward_error for r in self.cases if r.full_forward_error is not None), default=None)
        lines.append("")
        if worst_full is not None:
            lines.append(
                f"cross-engine: the engine's full forward (no cache) vs the float64 reference: worst error "
                f"{worst_full:.2e} (tolerance {self.tolerances['reference']['attn_logits']:g}; plain cases)"
            )
        if self.limits:
            lines.append(self.limits)
        if self.passed:
            lines.append(f"parity holds in all {len(self.cases)} cases ({self.seconds:.1f} s)")
        else:
            lines.append(f"parity FAILS in {n_fail} of {len(self.cases)} cases ({self.seconds:.1f} s)")
            first = next(r for r in self.cases if not r.passed)
            if first.first_divergence is not None:
                lines.append(f"first divergence in {first.case.label()} " + first.first_divergence.describe())
        if self.diagnosis is not None:
            source = self.diagnosis.details.get("case")
            lines.append(
                f"diagnosis: {self.diagnosis.kind}{f' (from case {source})' if source else ''}: "
                f"{self.diagnosis.evidence}"
            )
        return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def _num(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
    return x
