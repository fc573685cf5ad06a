"""``ropekv.check``: cached prefill + decode against full forwards, layer by layer.

For every case the adapter runs the cached path; each decode step's per-layer inputs and attention
logits are compared with (a) the engine's own full forward (self-parity) and (b) ropekv's independent
float64 reference decoder on the same checkpoint. For RoPE whose frequencies do not depend on length,
one full forward over the longest sequence serves every case with the same window (row ``t`` of a
causal forward is the reference for position ``t``); for dynamic NTK and LongRoPE each decode position
``t`` gets its own full forward over exactly ``t + 1`` tokens.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter
from typing import Any

import torch

from ..attention_kind import MODEL_WINDOWS
from ..contract import DTYPES
from ..errors import NotApplicable, UsageError
from ..models.computed import computation_fingerprint
from ..models.config import Checkpoint, ModelConfig
from ..models.reference import ReferenceDecoder, ReferenceOutput
from ..probe import LayerProbe
from . import ops
from .adapter_diagnosis import diagnose_mislabelled_keys
from .applicable import Applicability, applicability
from .bug_class import BugClass
from .cases import Case, ImageGrid, build_matrix, check_numbers, slide_note, token_stream
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
    tolerance_for,
    worst_entry,
)
from .diagnosis import Diagnosis
from .layer_diagnosis import diagnose_divergence, diagnose_unlocated
from .progress import Progress
from .protocol import CaseRun, EngineAdapter, EngineDescription, FullRun, StepRecord, Tier
from .provenance import provenance
from .reference_cache import (
    COMPUTED,
    HIT,
    RECOMPUTED,
    EntryProblem,
    ReferenceSource,
    ReferenceStore,
    RowsShape,
    entry_fields,
    fit,
)
from .report import CaseResult, Divergence, ParityReport, plural
from .validate import check_adapter, check_case_run, check_description, check_full_run, check_ignored

_MAX_FORENSIC_CASES = 6
REFERENCE_DTYPES = ("float64", "float32")  # names in ropekv.contract.DTYPES the reference decoder runs in
if not set(REFERENCE_DTYPES) <= set(DTYPES):
    raise AssertionError(f"reference dtypes {REFERENCE_DTYPES} must be names in ropekv.contract.DTYPES")


def check(
    engine: EngineAdapter,
    *,
    lengths: list[int] | None = None,
    block_sizes: list[int] | None = None,
    prefix_offsets: list[int] | None = None,
    window: int | None = None,
    sink_tokens: int = 0,
    chunk: int | None = None,
    decode_steps: int | None = None,
    dtype: str | None = None,
    reference: str = "float64",
    key_form: str | None = None,
    backend: str | None = None,
    seed: int = 0,
    cases: list[Case] | None = None,
    progress: bool | str = False,
    tolerance: Tolerance | None = None,
    reference_cache: str | os.PathLike[str] | ReferenceStore | None = None,
) -> ParityReport:
    """Run the parity matrix on ``engine`` and return a :class:`ParityReport`.

    ``engine`` is an adapter (see :class:`ropekv.parity.protocol.EngineAdapter`; ``ropekv.check`` also
    takes a checkpoint, for ropekv's own engine). ``key_form``/``backend``/``dtype`` given with an adapter
    must be what it runs (else UsageError: the harness cannot change an engine). The other keywords mean
    what the CLI flags of the same name mean; None means the default matrix. ``progress``: False, True
    or ``"bar"`` (a live bar on stderr), ``"lines"`` (one plain line per case, for CI logs).
    ``tolerance`` replaces the per-dtype tolerance for both comparisons, for an engine whose noise is
    not set by its compute dtype (quantized weights, an f16 cache; the adapter's docs justify it).
    Every adapter result is validated against its case first (AdapterError on a violation).
    ``reference_cache``: a folder (or a :class:`~ropekv.parity.reference_cache.ReferenceStore`) where
    each case's float64 reference rows are stored and read back by later checks of the same model on
    any engine (:mod:`ropekv.parity.reference_cache`; UsageError if it is not a writable folder);
    the report says per case where its reference came from. The engine side is never stored.

    A case that does not apply to the model or the engine (:mod:`ropekv.parity.applicable`; or one
    whose ``run_case`` raises :class:`~ropekv.errors.NotApplicable`) is reported as ``n/a`` with the
    reason and not judged; the verdict is over the others. When no case is left to judge,
    NotApplicable is raised: nothing judged is not a pass.
    """
    adapter = _as_adapter(engine, dtype=dtype, key_form=key_form, backend=backend)
    tier = check_adapter(adapter)
    if reference not in REFERENCE_DTYPES:
        raise UsageError(f"reference must be one of {', '.join(REFERENCE_DTYPES)}, got {reference!r}")
    if reference_cache is None or isinstance(reference_cache, ReferenceStore):
        store = reference_cache
    else:
        # UsageError unless a writable folder (or one that can be created), before any work
        store = ReferenceStore(reference_cache, "reference_cache")
    cfg = adapter.checkpoint.config
    if cases is None:
        cases = build_matrix(
            lengths=lengths,
            block_sizes=block_sizes,
            prefix_offsets=prefix_offsets,
            window=window,
            sink_tokens=sink_tokens,
            chunk=chunk,
            decode_steps=decode_steps,
            max_positions=cfg.position_limit,
        )
    if not cases:
        raise UsageError("no parity cases to run")
    plans = _plan(adapter, cfg, cases)
    cases = [p.case for p in plans]
    judged = [p.case for p in plans if p.not_applicable is None]
    _refuse_nothing_judged(plans)
    started = time.perf_counter()
    tokens = token_stream(cfg.vocab_size, max(c.total for c in judged), seed)
    refs = _References(adapter, tier, reference, tokens, judged, store)
    tol_ref = tolerance or tolerance_for(adapter.dtype, DTYPES[reference])
    tol_self = tolerance or tolerance_for(adapter.dtype, adapter.dtype)

    results: list[CaseResult] = []
    failed: list[tuple[CaseResult, CaseRun]] = []
    with Progress(total=refs.work + sum(c.total for c in judged), mode=progress) as bar:
        refs.bar = bar
        for n, plan in enumerate(plans):
            case = plan.case
            noted = tuple(x.text for x in plan.noted)
            if plan.not_applicable is not None:
                results.append(CaseResult.skipped(case, plan.not_applicable, noted))
                bar.case_done(f"case {n + 1}/{len(cases)} {case.label()}: n/a ({plan.not_applicable})")
                continue
            bar.describe(f"case {n + 1}/{len(cases)} {case.label()}: cached run")
            t0 = time.perf_counter()
            r0 = time.perf_counter()
            try:
                raw_run = adapter.run_case(case, tokens)
            except NotApplicable as exc:  # the adapter's own word that the case does not apply
                results.append(CaseResult.skipped(case, str(exc), noted, time.perf_counter() - t0))
                bar.case_done(f"case {n + 1}/{len(cases)} {case.label()}: n/a ({exc})")
                refs.done(case)
                continue
            refs.seconds["cached_runs"] += time.perf_counter() - r0
            run = check_case_run(adapter, tier, cfg, case, raw_run)
            bar.advance(case.total)
            refs.prepare(case)
            ref_rows = [refs.reference_row(case, s.position) for s in run.steps]
            refs.done_with_reference(case)  # its probes go before the engine's full forward, if no case reads them
            self_rows = [refs.self_row(case, s.position) for s in run.steps]
            of = LogitsOf(cfg, case.window, case.sink_tokens)
            err_ref = [compare_step(s.layers, _next(s), s.position, r, of) for s, r in zip(run.steps, ref_rows)]
            err_self = [compare_step(s.layers, _next(s), s.position, r, of) for s, r in zip(run.steps, self_rows)]
            # Cross-engine parity (no cache) is a property of plain rows; an operation's self rows are
            # relabelled or borrowed from the reference (ops.py), so they say nothing about it.
            full_err = max(_rows_error(a, b) for a, b in zip(self_rows, ref_rows)) if case.op is None else None
            fail_ref, fail_self = first_failure(err_ref, tol_ref), first_failure(err_self, tol_self)
            divergence = None
            if fail_ref is not None:
                divergence = _divergence("reference", fail_ref, run, ref_rows, err_ref, tol_ref, of)
            elif fail_self is not None:
                divergence = _divergence("self", fail_self, run, self_rows, err_self, tol_self, of)
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
                ignored=noted,
                notes=run.notes
                + ops.notes(case)
                + tuple(n for n in [slide_note(case, cfg.layer_attentions), refs.notes.get(case)] if n),
                full_forward_error=full_err,
                seconds=time.perf_counter() - t0,
                reference_source=refs.sources.get(case),
            )
            results.append(result)
            bar.case_done(
                f"case {n + 1}/{len(cases)} {case.label()}: {'PASS' if result.passed else 'FAIL'} "
                f"({result.seconds:.1f} s)"
            )
            if not result.passed and len(failed) < _MAX_FORENSIC_CASES:
                failed.append((result, run))
                refs.keep_rows(case, {s.position: r for s, r in zip(run.steps, ref_rows)})
            refs.done(case)
        # Logits clean, recorded attention not: the adapter's record is wrong, whatever the tier.
        diagnosis = None
        if tier >= Tier.ATTENTION:
            diagnosis = diagnose_mislabelled_keys(cfg, results, failed, refs.reference_row, tol_ref)
        if diagnosis is None and tier >= Tier.FORENSICS:
            # Forensics reads phases, and a query at position 1 or 2 has hardly turned (with theta = 1e5
            # most channel pairs stay put, so a wrong pairing looks like no rotation at all). The failing
            # case that diverged at the highest position carries the most evidence; the others follow.
            failed.sort(key=lambda item: _divergence_position(item[0]))
            for result, run in failed:
                bar.describe("forensics")
                found = _diagnose(adapter, refs, result, run)
                if diagnosis is None or diagnosis.kind == BugClass.UNKNOWN:
                    diagnosis = found if diagnosis is None or found.kind != BugClass.UNKNOWN else diagnosis
                if diagnosis.kind != BugClass.UNKNOWN:
                    break
    _refuse_nothing_judged([Applicability(r.case, (), r.not_applicable) for r in results])
    ckpt = adapter.checkpoint
    passed = all(r.passed for r in results if r.not_applicable is None)
    from ..models.default import display_name  # local: the default-model module pulls in the GGUF reader

    return ParityReport(
        passed=passed,
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
        engine=_describe(adapter).to_dict(),
        reference=reference,
        tier=tier.value,
        limits=tier_limits(tier, results, diagnosis),
        tolerances={"reference": tol_ref.to_dict(), "self": tol_self.to_dict()},
        cases=tuple(results),
        diagnosis=diagnosis,
        seconds=time.perf_counter() - started,
        seed=seed,
        phase_seconds=dict(refs.seconds),
        reference_cache=None if store is None else refs.cache_summary(),
        provenance=provenance(
            f"ropekv.check({adapter.name!r}, {plural(len(cases), 'case')}, seed={seed}, reference={reference!r})"
        ),
    )


def _plan(adapter: EngineAdapter, cfg: ModelConfig, cases: list[Case]) -> list[Applicability]:
    """Each case as it meets the model (its own windows recorded, :meth:`Case.for_model`) and the
    engine: the ignored parameters it is judged without, or why it does not apply. A case that applies
    must keep its numbers within the model's positions (UsageError otherwise)."""
    facts = _describe(adapter)
    if facts.name is None:
        facts = dataclasses.replace(facts, name=adapter.name)
    plans = []
    for c in cases:
        if not isinstance(c, Case):
            raise UsageError(f"cases must be Case records, got {type(c).__name__}")
        case = c.for_model(cfg.layer_attentions)
        plan = applicability(case, cfg, facts, check_ignored(adapter, case, adapter.ignored(case)))
        if plan.not_applicable is None:
            check_numbers(case, cfg.position_limit)
        plans.append(plan)
    return plans


def _refuse_nothing_judged(plans: list[Applicability]) -> None:
    """NotApplicable when no case applies: a report with nothing judged would read as a pass."""
    if any(p.not_applicable is None for p in plans):
        return
    shown = "; ".join(f"{p.case.label()}: {p.not_applicable}" for p in plans[:3])
    more = f"; and {plural(len(plans) - 3, 'more case')}" if len(plans) > 3 else ""
    raise NotApplicable(f"no case applies to this model and engine, so nothing was judged (not a pass): {shown}{more}")


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


def _divergence_position(result: CaseResult) -> int:
    """Sort key of the failing cases for forensics: the highest divergence position first."""
    fd = result.first_divergence
    return -fd.query_position if fd else 0


def _next(step: StepRecord) -> NextToken:
    return NextToken(step.logits, step.token_ids)


def _as_adapter(engine: Any, *, dtype: str | None, key_form: str | None, backend: str | None) -> EngineAdapter:
    """``engine`` (any object a caller passed) as a checked adapter, or UsageError/AdapterError."""
    if isinstance(engine, Checkpoint):
        raise UsageError(
            "ropekv.parity.harness.check takes an engine adapter; ropekv.check(checkpoint) runs a "
            "checkpoint on ropekv's own engine"
        )
    if engine is None or isinstance(engine, (str, bytes)):
        raise UsageError(f"check() needs an engine adapter, got {type(engine).__name__}")
    check_adapter(engine)
    name = engine.name
    if dtype is not None:
        want = DTYPES.get(dtype)
        if want is None:
            raise UsageError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if want != engine.dtype:
            raise UsageError(
                f"dtype={dtype!r}: adapter {name!r} computes in {engine.dtype}; build the adapter in "
                f"{dtype} instead (the harness cannot change an engine's dtype)"
            )
    facts = _describe(engine)
    for option, value, runs in (("key_form", key_form, facts.key_form), ("backend", backend, facts.backend)):
        if value is not None and runs != value:
            raise UsageError(
                f"{option}={value!r}: adapter {name!r} does not run with it (it reports "
                f"{option}={runs!r}); {option} selects ropekv's own engine"
            )
    adapter: EngineAdapter = engine
    return adapter


def _describe(adapter: EngineAdapter) -> EngineDescription:
    return check_description(adapter, adapter.describe())


def _rows_error(engine_row: RefRow, ref_row: RefRow) -> float:
    """Cross-engine parity without any cache: the engine's own full forward against the float64
    reference at the same row, worst over layers (attention logits) and the final logits."""
    errs = [scaled_error(a, b) for a, b in zip(engine_row.attn_logits, ref_row.attn_logits)]
    return max(errs + [logits_error(engine_row.logits, ref_row.logits)[0]])


def _max(errors: list[StepErrors]) -> float | None:
    if not any(e.attn for e in errors):
        return None
    return max(max(e.attn) for e in errors)


class _References:
    """Full forwards (float64 reference and the engine's own), computed once per window and reused;
    with a :class:`ReferenceStore`, each case's reference rows are read from it when it holds them
    (the decoder is then never built) and stored there when computed."""

    def __init__(
        self,
        adapter: EngineAdapter,
        tier: Tier,
        reference: str,
        tokens: torch.Tensor,
        cases: list[Case],
        store: ReferenceStore | None = None,
    ):
        self.adapter, self.tier, self.reference, self.tokens, self.store = adapter, tier, reference, tokens, store
        self.cfg = adapter.checkpoint.config
        self._decoder: ReferenceDecoder | None = None
        self._stored: dict[Case, dict[int, RefRow]] = {}  # a case's reference rows by position, from the store
        self.sources: dict[Case, ReferenceSource] = {}
        self.notes: dict[Case, str] = {}  # why an entry was recomputed, or could not be stored
        self.cache_seconds = {"saved": 0.0, "spent": 0.0}
        self.per_position = self.cfg.rope.length_dependent
        self.bar: Progress | None = None
        # the store's key: what the model computes, so a gptj presentation (llama.cpp's) of the same
        # weights reads the rows a neox one stored (ropekv.models.computed)
        self._model_key: str | None = None
        self.seconds = {"float64_reference_forwards": 0.0, "engine_full_forwards": 0.0, "cached_runs": 0.0}
        self._rows: dict[_Group, list[int]] = {}
        self._cases: dict[_Group, Case] = {}
        for c in cases:
            # A cache operation's case reads the plain forwards at ops.self_rows (and, for evict and
            # shift, a float64 forward of its own, see ropekv.parity.ops).
            rows = c.decode_positions if c.op is None else ops.self_rows(c)
            if rows:
                self._rows.setdefault(self._group(c), []).extend(rows)
                self._cases.setdefault(self._group(c), dataclasses.replace(c, op=None))
        self._ref: dict[_Key, ReferenceOutput] = {}
        self._op_ref: dict[Case, ReferenceOutput] = {}  # an evict or shift case's own reference
        self._self: dict[_Key, FullRun] = {}
        # How many cases still to be judged read each forward. One is dropped after its last reader:
        # their probes hold every position's keys and values per layer (at 32,766 tokens of Gemma 3
        # 270M, 3.6 GB in float64 and 1.8 GB from the engine). Forensics reads a dropped reference
        # again by recomputing it (the same float64 forward, the same values), once per case it reads.
        self._readers: Counter[_Use] = Counter(use for c in cases for use in self._uses(c))
        self._kept: dict[Case, dict[int, RefRow]] = {}  # a failed case's reference rows, for the diagnoses
        self._reference_done: set[Case] = set()  # cases whose reference forwards are released
        if self.per_position:
            self.work = 2 * sum(t + 1 for rows in self._rows.values() for t in set(rows))
        else:
            self.work = 2 * sum(max(rows) + 1 for rows in self._rows.values())
        self.work += sum(max(c.decode_positions) + 1 - c.shift for c in cases if ops.needs_own_reference(c))

    @property
    def decoder(self) -> ReferenceDecoder:
        """The float64 decoder, built on first use (its weight copy is skipped when the store has every row)."""
        if self._decoder is None:
            self._decoder = ReferenceDecoder(self.adapter.checkpoint, dtype=DTYPES[self.reference])
        return self._decoder

    def prepare(self, case: Case) -> None:
        """With a store: ``case``'s reference rows from it, or computed (the forward shared with the other
        cases of its window, as without a store) and stored; the source is recorded for the report."""
        if self.store is None or case in self.sources:
            return
        if self._model_key is None:
            self._model_key = computation_fingerprint(self.adapter.checkpoint)
        fields = entry_fields(self._model_key, self.reference, case, self.tokens)
        cfg = self.cfg
        positions = tuple(sorted(set(case.decode_positions)))
        shape = RowsShape(
            positions, cfg.num_layers, cfg.num_heads, cfg.hidden_size, cfg.vocab_size, DTYPES[self.reference]
        )
        problem = None
        try:
            stored = self.store.load(fields, shape)
        except EntryProblem as exc:
            stored, problem = None, str(exc)
        if stored is not None:
            rows = {t: fit(row, self._width(case, t, stored.widths[t])) for t, row in stored.rows.items()}
            if all(r is not None for r in rows.values()):
                self._stored[case] = {t: r for t, r in rows.items() if r is not None}
                self.sources[case] = HIT
                self.cache_seconds["saved"] += stored.seconds
                return
            problem = "its attention rows are wider than this check's forwards"
        before = self.seconds["float64_reference_forwards"]
        computed = {t: self._computed_row(case, t) for t in positions}
        spent = self.seconds["float64_reference_forwards"] - before
        self.cache_seconds["spent"] += spent
        widths = {t: max((a.shape[1] for a in row.attn_logits), default=1) for t, row in computed.items()}
        self.sources[case] = COMPUTED if problem is None else RECOMPUTED
        if problem is not None:
            self.notes[case] = f"reference: recomputed, the cached entry was not valid ({problem})"
        try:
            self.store.save(fields, computed, widths, spent)
        except OSError as exc:
            self.notes[case] = f"reference: computed but not stored ({exc.strerror or exc})"
        self._stored[case] = computed

    def _width(self, case: Case, t: int, stored_width: int) -> int:
        """Columns of row ``t``'s attention as this check computes them: the own forward of an evict or
        shift case is the case's alone (its stored width); a plain row spans its shared forward."""
        if case.op is not None and ops.needs_own_reference(case):
            return stored_width
        return max(self._rows_for(self._key(case, t))) + 1

    def cache_summary(self) -> dict[str, Any]:
        """The report's ``reference_cache`` block (docs/report.md)."""
        counted = list(self.sources.values())
        return {
            "folder": None if self.store is None else str(self.store.folder),
            "hits": counted.count(HIT),
            "computed": counted.count(COMPUTED),
            "recomputed": counted.count(RECOMPUTED),
            "seconds_saved": self.cache_seconds["saved"],
            "seconds_spent": self.cache_seconds["spent"],
        }

    @staticmethod
    def _group(case: Case) -> _Group:
        return (case.window, case.sink_tokens, case.image)

    def _key(self, case: Case, t: int) -> _Key:
        return (self._group(case), t if self.per_position else None)

    def _rows_for(self, key: _Key) -> list[int]:
        group, t = key
        return [t] if t is not None else sorted(set(self._rows[group]))

    def reference_output(self, case: Case, t: int) -> tuple[ReferenceOutput, int]:
        if case.op is not None and ops.needs_own_reference(case):
            if case not in self._op_ref:
                if self.bar:
                    self.bar.describe(f"float64 reference forward for {case.op.label()}")
                decoder = self.decoder  # built outside the timer: the phase times forwards only
                t0 = time.perf_counter()
                self._op_ref[case] = ops.own_reference(decoder, case, self.tokens)
                self.seconds["float64_reference_forwards"] += time.perf_counter() - t0
                if self.bar:
                    self.bar.advance(max(case.decode_positions) + 1 - case.shift)
            out = self._op_ref[case]
            return out, _index(out.rows, t)
        key = self._key(case, t)
        if key not in self._ref:
            rows = self._rows_for(key)
            n = max(rows) + 1
            if self.bar:
                self.bar.describe(f"float64 reference forward over {n} tokens")
            window = MODEL_WINDOWS if case.window is None else case.window
            decoder = self.decoder
            t0 = time.perf_counter()
            self._ref[key] = decoder.forward(
                self.tokens[:n],
                probe_rows=rows,
                window=window,
                sink_tokens=case.sink_tokens,
                logits_for="probed",
                streams=case.position_streams(),
            )
            self.seconds["float64_reference_forwards"] += time.perf_counter() - t0
            if self.bar:
                self.bar.advance(n)
        out = self._ref[key]
        return out, _index(out.rows, t)

    def reference_row(self, case: Case, t: int) -> RefRow:
        stored = self._stored.get(case) or self._kept.get(case)
        if stored is not None and t in stored:
            return stored[t]
        return self._computed_row(case, t)

    def keep_rows(self, case: Case, rows: dict[int, RefRow]) -> None:
        """Keep a failed case's reference rows (by position) for the diagnoses after the last case."""
        self._kept[case] = rows

    def done_with_reference(self, case: Case) -> None:
        """``case``'s reference rows are taken: drop the reference forwards no case still to be judged reads
        (not when its self rows are reference rows too)."""
        if not ops.self_from_reference(case):
            self._release(self._reference_uses(case))
            self._reference_done.add(case)

    def done(self, case: Case) -> None:
        """``case`` is judged: drop every forward no case still to be judged reads."""
        uses = self._uses(case)
        if case in self._reference_done:
            uses -= self._reference_uses(case)
        self._release(uses)

    def _release(self, uses: set[_Use]) -> None:
        for use in uses:
            self._readers[use] -= 1
            if self._readers[use] <= 0:
                what, key = use
                if isinstance(key, Case):
                    self._op_ref.pop(key, None)
                elif what == "reference":
                    self._ref.pop(key, None)
                else:
                    self._self.pop(key, None)

    def _uses(self, case: Case) -> set[_Use]:
        """The forwards judging ``case`` reads (as :meth:`reference_row` and :meth:`self_row` find them)."""
        ref = self._reference_uses(case)
        if ops.self_from_reference(case):
            return ref
        return ref | {("engine", self._key(case, t - case.shift)) for t in case.decode_positions}

    def _reference_uses(self, case: Case) -> set[_Use]:
        if ops.needs_own_reference(case):
            return {("op", case)}
        return {("reference", self._key(case, t)) for t in case.decode_positions}

    def _computed_row(self, case: Case, t: int) -> RefRow:
        out, i = self.reference_output(case, t)
        logits = out.logits[i] if out.probed_logits else out.logits[t - case.shift]
        if out.rows is None:
            raise UsageError("the reference forward was run without probed rows")
        return ops.hide_evicted(case, _row(out.layers, out.rows, i, NextToken(logits), case, self.cfg))

    def self_row(self, case: Case, t: int) -> RefRow:
        if ops.self_from_reference(case):
            return self.reference_row(case, t)
        if case.shift:  # the unshifted forward, relabelled (scores depend on i - j only)
            row = self._plain_self_row(case, t - case.shift, case.shift)
            return row
        return self._plain_self_row(case, t, 0)

    def _plain_self_row(self, case: Case, t: int, relabel: int) -> RefRow:
        key = self._key(case, t)
        if key not in self._self:
            rows = self._rows_for(key)
            n = max(rows) + 1
            if self.bar:
                self.bar.describe(f"engine full forward over {n} tokens")
            group_case = self._cases[self._group(case)]
            t0 = time.perf_counter()
            run = self.adapter.full_forward(self.tokens[:n], rows, group_case)
            self.seconds["engine_full_forwards"] += time.perf_counter() - t0
            self._self[key] = check_full_run(self.adapter, self.tier, self.cfg, group_case, rows, n, run)
            if self.bar:
                self.bar.advance(n)
        run = self._self[key]
        i = _index(run.rows, t)
        ids = None if run.token_ids is None else run.token_ids[i]
        layers = run.layers if self.tier >= Tier.ATTENTION else ()
        if relabel:
            layers = tuple(dataclasses.replace(p, key_positions=p.key_positions + relabel) for p in layers)
        return _row(layers, run.rows + relabel, i, NextToken(run.logits[i], ids), case, self.cfg)


_Group = tuple[int | None, int, ImageGrid | None]  # (window, sink_tokens, image): cases sharing full forwards
_Key = tuple[_Group, int | None]  # a group and, for length-dependent RoPE, the one position t forwarded
_Use = tuple[str, "_Key | Case"]  # ("reference" | "engine", key) or ("op", case): a forward a case reads


def _index(rows: torch.Tensor | None, t: int) -> int:
    """Where position ``t`` is among the probed ``rows [R]``."""
    if rows is None:
        raise UsageError("the forward was run without probed rows")
    return int(torch.nonzero(torch.eq(rows, t))[0, 0])


def _row(
    layers: tuple[LayerProbe, ...], rows: torch.Tensor, i: int, logits: NextToken, case: Case, cfg: ModelConfig
) -> RefRow:
    """Row ``i`` of probed layers: per layer its input and attention logits ``[H, T]``."""
    of = LogitsOf(cfg, case.window, case.sink_tokens)
    r = rows[i : i + 1]
    hidden = tuple(None if p.hidden_in is None else p.hidden_in[i] for p in layers)
    attn = tuple(_dense(of.rows(layer, _at(p, i), r)[:, 0], p.key_positions) for layer, p in enumerate(layers))
    return RefRow(hidden_in=hidden, attn_logits=attn, logits=logits)


def _at(p: LayerProbe, i: int) -> LayerProbe:
    """The probe restricted to query row ``i`` (keys unchanged)."""
    return dataclasses.replace(
        p,
        q=p.q[i : i + 1],
        hidden_in=None if p.hidden_in is None else p.hidden_in[i : i + 1],
        q_raw=None if p.q_raw is None else p.q_raw[i : i + 1],
    )


def _dense(scores: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """``[H, N]`` scores at ``key_positions`` as ``[H, T]`` indexed by position (-inf where no key)."""
    T = int(key_positions.max()) + 1
    out = torch.full((scores.shape[0], T), float("-inf"), dtype=scores.dtype)
    out[:, key_positions] = scores
    return out


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
    cached_attn = of.step(layer, probe, step.position)
    ref_attn = rows[s].attn_logits[layer][:, probe.key_positions]
    head, k, cached, refv = worst_entry(cached_attn, ref_attn)
    input_err = errors[s].hidden[layer]
    slot = -1 if probe.key_slots is None else int(probe.key_slots[k])
    return Divergence(
        against=against,
        step=s,
        query_position=step.position,
        layer=layer,
        head=head,
        key_position=int(probe.key_positions[k]),
        key_slot=slot,
        reference_logit=refv,
        cached_logit=cached,
        attn_error=errors[s].attn[layer],
        input_error=input_err,
        input_matched=input_err <= tol.hidden,
        logits_error=errors[s].logits,
    )


def _diagnose(adapter: EngineAdapter, refs: _References, result: CaseResult, run: CaseRun) -> Diagnosis:
    """The forensics of a failing case at its first divergence, from what the engine and the
    reference computed there (:mod:`ropekv.parity.layer_diagnosis` names the bug)."""
    fd = result.first_divergence
    if fd is None or fd.layer is None:
        return diagnose_unlocated(fd)
    case = result.case
    out, i = refs.reference_output(case, fd.query_position)
    return diagnose_divergence(
        adapter.checkpoint.config,
        case,
        fd,
        view=run.steps[fd.step].layers[fd.layer],
        reference=out.layers[fd.layer],
        row=i,
        reference_attn=refs.reference_row(case, fd.query_position).attn_logits[fd.layer],
        handoff_len=run.handoff_len,
        self_parity_passed=result.self_passed,
        key_form=_describe(adapter).key_form,
    )
