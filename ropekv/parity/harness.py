"""``ropekv.check``: cached prefill + decode against full forwards, layer by layer, in five stages.

1. **plan** (:mod:`.plan`): the adapter checked, the cases met with the model and the engine;
2. **run** (:mod:`.run`): each case's cached path on the engine, its record validated;
3. **judge** (:mod:`.judge`): each decode step against the float64 reference and the engine's own
   full forward (:mod:`.references` computes and shares them), the verdict, and a failing case's
   evidence;
4. **diagnose** (:mod:`.diagnose`): one diagnosis across every failing case, from the bug classes the
   request carries (:mod:`ropekv.bugs.registry` through ``ropekv.check``);
5. **report** (:mod:`.conclude`): the :class:`~ropekv.parity.report.ParityReport`.

Cases run one at a time and their forwards are dropped after their last reader, so a check holds one
case's probes (and the small key maps of the failing ones) at a time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from .cases import Case
from .compare import Tolerance
from .conclude import conclude
from .diagnose import EngineFacts, diagnose
from .explain.evidence import CaseEvidence, Explanation
from .judge import judge
from .plan import make_plan
from .progress import Progress
from .protocol import EngineAdapter, Tier
from .reference_cache import ReferenceStore
from .references import References
from .report import CaseResult, ParityReport
from .request import CheckRequest, MatrixOptions
from .run import run_case


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
    explanations: Sequence[Explanation],
) -> ParityReport:
    """Run the parity matrix on ``engine`` (a :class:`~ropekv.parity.protocol.EngineAdapter`) and return
    a :class:`ParityReport`: :func:`run_check` of the :class:`~ropekv.parity.request.CheckRequest` the
    keywords make (each means what the CLI flag of the same name means; None: the default matrix).

    ``key_form``/``backend``/``dtype`` given with an adapter must be what it runs (else UsageError: the
    harness cannot change an engine). ``progress``: False, True or ``"bar"`` (a live bar on stderr),
    ``"lines"`` (one plain line per case, for CI logs). ``tolerance`` replaces the per-dtype tolerance
    for both comparisons, for an engine whose noise is not set by its compute dtype (quantized
    weights, an f16 cache; the adapter's docs justify it). ``reference_cache``: a folder (or a
    :class:`~ropekv.parity.reference_cache.ReferenceStore`) where each case's float64 reference rows
    are stored and read back by later checks of the same model on any engine. ``explanations``: the
    bug classes the diagnosis tries, in order (required: :data:`ropekv.bugs.registry.EXPLANATIONS`,
    which ``ropekv.check`` passes; an empty tuple names no class and only describes the key map).

    A case that does not apply to the model or the engine is reported as ``n/a`` with the reason and
    not judged; when no case is left to judge, NotApplicable is raised: nothing judged is not a pass.
    """
    matrix = MatrixOptions(
        lengths=None if lengths is None else tuple(lengths),
        block_sizes=None if block_sizes is None else tuple(block_sizes),
        prefix_offsets=None if prefix_offsets is None else tuple(prefix_offsets),
        window=window,
        sink_tokens=sink_tokens,
        chunk=chunk,
        decode_steps=decode_steps,
    )
    request = CheckRequest(
        engine=engine,
        cases=None if cases is None else tuple(cases),
        matrix=matrix,
        dtype=dtype,
        key_form=key_form,
        backend=backend,
        reference=reference,
        seed=seed,
        progress=progress,
        tolerance=tolerance,
        reference_cache=reference_cache,
        explanations=tuple(explanations),
    )
    return run_check(request)


def run_check(request: CheckRequest) -> ParityReport:
    """The five stages of a check (module docstring) on ``request``."""
    plan = make_plan(request)
    started = time.perf_counter()
    judged = list(plan.judged)
    refs = References(plan.adapter, plan.tier, request.reference, plan.tokens, judged, plan.store)
    engine = EngineFacts(
        key_form=plan.description.key_form,
        dtype=plan.adapter.dtype,
        kv_dtype=plan.description.extra.get("kv_dtype")
        if isinstance(plan.description.extra.get("kv_dtype"), str)
        else None,
    )
    results: list[CaseResult] = []
    evidences: list[CaseEvidence] = []
    total = len(plan.cases)
    with Progress(total=refs.work + sum(c.total for c in judged), mode=request.progress) as bar:
        refs.bar = bar
        for n, applies in enumerate(plan.cases):
            case = applies.case
            noted = tuple(x.text for x in applies.noted)
            at = f"case {n + 1}/{total} {case.label()}"
            if applies.not_applicable is not None:
                results.append(CaseResult.skipped(case, applies.not_applicable, noted))
                bar.case_done(f"{at}: n/a ({applies.not_applicable})")
                continue
            bar.describe(f"{at}: cached run")
            ran = run_case(plan, case)
            if ran.run is None:
                reason = ran.not_applicable or "not applicable"
                results.append(CaseResult.skipped(case, reason, noted, ran.seconds))
                bar.case_done(f"{at}: n/a ({reason})")
                refs.done(case)
                continue
            refs.seconds["cached_runs"] += ran.seconds
            bar.advance(case.total)
            judged_case = judge(plan, refs, case, ran.run, noted, ran.seconds, engine)
            result = judged_case.result
            results.append(result)
            if judged_case.evidence is not None:
                evidences.append(judged_case.evidence)
            bar.case_done(f"{at}: {'PASS' if result.passed else 'FAIL'} ({result.seconds:.1f} s)")
            refs.done(case)
        diagnosis = None
        if evidences and plan.tier >= Tier.ATTENTION:
            bar.describe("forensics")
            passing = [r.case for r in results if r.passed]
            diagnosis = diagnose(evidences, request.explanations, passing)
            if plan.tier < Tier.FORENSICS and diagnosis.kind != "mislabelled_keys":
                diagnosis = None  # the attention tier names the adapter's record only
    return conclude(plan, results, diagnosis, refs, started)
