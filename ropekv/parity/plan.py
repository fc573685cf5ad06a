"""The plan stage: the adapter checked, the cases met with the model and the engine, before any work.

:func:`make_plan` validates the adapter (its tier, what it says it runs against what the caller
expects), builds the matrix when no cases are given, decides per case whether it applies
(:mod:`ropekv.parity.applicable`: n/a with its reason), refuses a check where nothing would be
judged, and fixes the token stream and the tolerances. Everything a user can get wrong is refused
here, before a weight is read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..contract import DTYPES
from ..errors import NotApplicable, UsageError
from ..models.config import Checkpoint, ModelConfig
from .applicable import Applicability, applicability
from .cases import Case, build_matrix, check_numbers, token_stream
from .compare import Tolerance, tolerance_for
from .protocol import EngineAdapter, EngineDescription, Tier
from .reference_cache import ReferenceStore
from .report import plural
from .request import REFERENCE_DTYPES, CheckRequest
from .validate import check_adapter, check_description, check_ignored

if not set(REFERENCE_DTYPES) <= set(DTYPES):
    raise AssertionError(f"reference dtypes {REFERENCE_DTYPES} must be names in ropekv.contract.DTYPES")


@dataclass(frozen=True, eq=False)
class CheckPlan:
    """A check ready to run: the adapter at its tier, every case with its applicability, the cases to
    judge, the token stream they read, the two tolerances and the reference store (if any)."""

    request: CheckRequest
    adapter: EngineAdapter
    tier: Tier
    description: EngineDescription
    cases: tuple[Applicability, ...]
    tokens: torch.Tensor  # [max total] int64
    tol_reference: Tolerance
    tol_self: Tolerance
    store: ReferenceStore | None

    @property
    def cfg(self) -> ModelConfig:
        return self.adapter.checkpoint.config

    @property
    def judged(self) -> tuple[Case, ...]:
        return tuple(p.case for p in self.cases if p.not_applicable is None)


def make_plan(request: CheckRequest) -> CheckPlan:
    """The plan of ``request`` (UsageError / AdapterError / NotApplicable before any work)."""
    adapter = _as_adapter(request.engine, dtype=request.dtype, key_form=request.key_form, backend=request.backend)
    tier = check_adapter(adapter)
    store = request.reference_cache
    if store is not None and not isinstance(store, ReferenceStore):
        store = ReferenceStore(store, "reference_cache")  # UsageError unless a writable folder
    cfg = adapter.checkpoint.config
    cases = list(request.cases) if request.cases is not None else None
    if cases is None:
        m = request.matrix
        cases = build_matrix(
            lengths=None if m.lengths is None else list(m.lengths),
            block_sizes=None if m.block_sizes is None else list(m.block_sizes),
            prefix_offsets=None if m.prefix_offsets is None else list(m.prefix_offsets),
            window=m.window,
            sink_tokens=m.sink_tokens,
            chunk=m.chunk,
            decode_steps=m.decode_steps,
            max_positions=cfg.position_limit,
        )
    if not cases:
        raise UsageError("no parity cases to run")
    description = describe(adapter)
    plans = _applicability(adapter, cfg, cases, description)
    refuse_nothing_judged(plans)
    judged = [p.case for p in plans if p.not_applicable is None]
    tokens = token_stream(cfg.vocab_size, max(c.total for c in judged), request.seed)
    return CheckPlan(
        request=request,
        adapter=adapter,
        tier=tier,
        description=description,
        cases=tuple(plans),
        tokens=tokens,
        tol_reference=request.tolerance or tolerance_for(adapter.dtype, DTYPES[request.reference]),
        tol_self=request.tolerance or tolerance_for(adapter.dtype, adapter.dtype),
        store=store,
    )


def _applicability(
    adapter: EngineAdapter, cfg: ModelConfig, cases: list[Case], facts: EngineDescription
) -> list[Applicability]:
    """Each case as it meets the model (its own windows recorded, :meth:`Case.for_model`) and the
    engine: the ignored parameters it is judged without, or why it does not apply. A case that applies
    must keep its numbers within the model's positions (UsageError otherwise)."""
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


def refuse_nothing_judged(plans: list[Applicability]) -> None:
    """NotApplicable when no case applies: a report with nothing judged would read as a pass."""
    if any(p.not_applicable is None for p in plans):
        return
    shown = "; ".join(f"{p.case.label()}: {p.not_applicable}" for p in plans[:3])
    more = f"; and {plural(len(plans) - 3, 'more case')}" if len(plans) > 3 else ""
    raise NotApplicable(f"no case applies to this model and engine, so nothing was judged (not a pass): {shown}{more}")


def describe(adapter: EngineAdapter) -> EngineDescription:
    return check_description(adapter, adapter.describe())


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
    facts = describe(engine)
    for option, value, runs in (("key_form", key_form, facts.key_form), ("backend", backend, facts.backend)):
        if value is not None and runs != value:
            raise UsageError(
                f"{option}={value!r}: adapter {name!r} does not run with it (it reports "
                f"{option}={runs!r}); {option} selects ropekv's own engine"
            )
    adapter: EngineAdapter = engine
    return adapter
