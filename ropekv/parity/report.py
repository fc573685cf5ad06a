"""The parity report: what ``ropekv check`` returns, prints and writes as JSON (docs/report.md)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from .cases import Case
from .diagnosis import Diagnosis

REPORT_FORMAT = "ropekv.parity-report"
REPORT_VERSION = 4
# 2: tier, limits, provenance, logit_errors, notes; nullable layer fields
# 3: per case "outcome" ("pass", "fail", "n/a") and "not_applicable" (the reason); "judged" and
#    "not_applicable" counts; the case's "model_attention"; a "units" block
# 4: per case "reference_source" and a "reference_cache" block (null without --reference-cache)

Outcome = Literal["pass", "fail", "n/a"]

UNITS: dict[str, str] = {
    "max_abs_logit_diff": "absolute: max |cached - reference| of the final logits",
    "max_attn_error": "scale-aware: max |cached - ref| / max(1, max |ref|) of attention logits, worst step and layer",
    "max_self_attn_error": "scale-aware, as max_attn_error, against the engine's own full forward",
    "attn_errors": "[step][layer] scale-aware attention-logit errors against the float64 reference",
    "self_attn_errors": "[step][layer] scale-aware attention-logit errors against the engine's own full forward",
    "logit_errors": "[step] scale-aware next-token logits errors against the float64 reference",
    "self_logit_errors": "[step] scale-aware next-token logits errors against the engine's own full forward",
    "full_forward_error": "scale-aware: the engine's cache-free forward against the float64 reference",
    "first_divergence.reference_logit, first_divergence.cached_logit": "absolute attention-logit values",
    "first_divergence.attn_error, first_divergence.input_error, first_divergence.logits_error": "scale-aware",
    "tolerances": "scale-aware thresholds, compared with the scale-aware errors",
    "seconds, phase_seconds": "wall-clock seconds",
    "reference_cache.seconds_saved": "wall-clock seconds the stored entries read took to compute when stored",
    "reference_cache.seconds_spent": "wall-clock seconds of float64 forwards computing entries in this check",
}
"""What every number of the report measures (also written into the JSON as ``"units"``)."""


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
    # why the named key diverges where it is not a value difference: a key the query should see that
    # the kernel never read, or one it read that the reference's mask hides
    reason: str | None = None

    def describe(self) -> str:
        if self.layer is None:
            return (
                f"vs {self.against}: decode step {self.step} (query position {self.query_position}): next-token "
                f"logits error {self.logits_error:.3g} (logits tier: no layer information)"
            )
        where = "input matched" if self.input_matched else "input already differed"
        cached = "not read" if self.cached_logit == -math.inf else f"{self.cached_logit:.4g}"
        ref = "hidden" if self.reference_logit == -math.inf else f"{self.reference_logit:.4g}"
        return (
            f"vs {self.against}: decode step {self.step} (query position {self.query_position}), layer "
            f"{self.layer} ({where}), head {self.head}, key position {self.key_position} (slot {self.key_slot}): "
            f"reference {ref}, cached {cached}" + (f" ({self.reason})" if self.reason else "")
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
    """One case's verdict. A case that does not apply (``not_applicable``: the reason) was not run:
    its ``passed`` fields are False and its figures empty, and the report's verdict leaves it out."""

    case: Case
    passed: bool
    reference_passed: bool
    self_passed: bool
    max_abs_logit_diff: float | None  # final logits against the reference (None: not judged)
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
    not_applicable: str | None = None  # why the case does not apply to this model or engine (not judged)
    # where the case's float64 reference rows came from with a reference cache: "cache hit", "computed",
    # "recomputed (corrupt entry)"; None without a cache (always computed) and for a case not judged
    reference_source: str | None = None

    def __post_init__(self) -> None:
        if self.not_applicable is not None and (self.passed or self.first_divergence is not None):
            raise ValueError("a case that does not apply is neither passed nor diverged")

    @classmethod
    def skipped(cls, case: Case, reason: str, ignored: tuple[str, ...] = (), seconds: float = 0.0) -> CaseResult:
        """The result of a case that does not apply, with the reason (it was not run)."""
        return cls(
            case=case,
            passed=False,
            reference_passed=False,
            self_passed=False,
            max_abs_logit_diff=None,
            max_attn_error=None,
            max_self_attn_error=None,
            first_divergence=None,
            positions=(),
            attn_errors=(),
            self_attn_errors=(),
            ignored=ignored,
            full_forward_error=None,
            seconds=seconds,
            not_applicable=reason,
        )

    @property
    def outcome(self) -> Outcome:
        if self.not_applicable is not None:
            return "n/a"
        return "pass" if self.passed else "fail"

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": self.case.to_dict(),
            "label": self.case.label(),
            "outcome": self.outcome,
            "not_applicable": self.not_applicable,
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
            "reference_source": self.reference_source,
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
    # with a reference cache (ropekv.parity.reference_cache): its folder, how many cases' references were
    # read ("hits"), "computed" and "recomputed" (a corrupt entry), and the float64 seconds saved / spent
    reference_cache: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.passed and (not self.judged or any(r.outcome == "fail" for r in self.cases)):
            raise ValueError("a report passes only when some case was judged and every judged case passed")

    @property
    def judged(self) -> tuple[CaseResult, ...]:
        """The cases that applied and were run (the verdict is over these)."""
        return tuple(r for r in self.cases if r.not_applicable is None)

    @property
    def not_applicable(self) -> tuple[CaseResult, ...]:
        return tuple(r for r in self.cases if r.not_applicable is not None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": REPORT_FORMAT,
            "version": REPORT_VERSION,
            "passed": self.passed,
            "judged": len(self.judged),
            "not_applicable": len(self.not_applicable),
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
            "reference_cache": None
            if self.reference_cache is None
            else {k: round(v, 3) if isinstance(v, float) else v for k, v in self.reference_cache.items()},
            "units": dict(UNITS),
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
                f"{r.case.label():<{w}} {r.outcome.upper() if r.outcome != 'n/a' else 'n/a':<7} "
                f"{_fmt(r.max_abs_logit_diff):>11} {_fmt(r.max_attn_error):>9} {_fmt(r.max_self_attn_error):>9}  {where}"
            )
            if r.not_applicable is not None:
                lines.append(f"{'':<{w}} not applicable: {r.not_applicable}")
            if r.ignored:
                lines.append(f"{'':<{w}} note: ignored for this engine: {', '.join(r.ignored)}")
            if r.reference_source is not None:
                lines.append(f"{'':<{w}} reference: {r.reference_source}")
            for note in r.notes:
                lines.append(f"{'':<{w}} note: {note}")
        judged = self.judged
        n_fail = sum(r.outcome == "fail" for r in judged)
        worst_full = max((r.full_forward_error for r in judged if r.full_forward_error is not None), default=None)
        lines.append("")
        if worst_full is not None:
            lines.append(
                f"cross-engine: the engine's full forward (no cache) vs the float64 reference: worst error "
                f"{worst_full:.2e} (tolerance {self.tolerances['reference']['attn_logits']:g}; plain cases)"
            )
        if self.limits:
            lines.append(self.limits)
        if self.reference_cache is not None:
            lines.append(self.cache_line())
        skipped = len(self.not_applicable)
        na = f"; {plural(skipped, 'case')} not applicable" if skipped else ""
        counted = plural(len(judged), "judged case" if skipped else "case")
        if self.passed:
            every = "all " if len(judged) > 1 else ""
            lines.append(f"parity holds in {every}{counted}{na} ({self.seconds:.1f} s)")
        else:
            lines.append(f"parity FAILS in {n_fail} of {counted}{na} ({self.seconds:.1f} s)")
            first = next((r for r in judged if r.outcome == "fail"), None)
            if first is not None and first.first_divergence is not None:
                lines.append(f"first divergence in {first.case.label()} " + first.first_divergence.describe())
        if self.diagnosis is not None:
            source = self.diagnosis.details.get("case")
            lines.append(
                f"diagnosis: {self.diagnosis.kind}{f' (from case {source})' if source else ''}: "
                f"{self.diagnosis.evidence}"
            )
        return "\n".join(lines)

    def cache_line(self) -> str:
        """One line on the reference cache: how many cases' references it gave, and the time saved."""
        c = self.reference_cache or {}
        return (
            f"reference cache {c.get('folder')}: {plural(c.get('hits', 0), 'case')} from the cache, "
            f"{c.get('computed', 0)} computed, {c.get('recomputed', 0)} recomputed (corrupt entry); "
            f"float64 reference {c.get('seconds_saved', 0.0):.1f} s saved, {c.get('seconds_spent', 0.0):.1f} s spent"
        )


def plural(n: int, noun: str) -> str:
    """``1 case``, ``2 cases``, ``0 cases``; a compound noun takes the plural on its last word."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def _num(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
    return x
