"""The run stage: one case's cached path on the engine, validated against the case.

The adapter runs the case (prefix hit, prefill, the operation, decode) and records what its kernels
used; :func:`~ropekv.parity.validate.check_case_run` holds the record to the case before anything is
compared (AdapterError on a violation). An adapter's own word that a case does not apply
(:class:`~ropekv.errors.NotApplicable`, raised before it produced anything) is the case's n/a.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..errors import NotApplicable
from .cases import Case
from .plan import CheckPlan
from .protocol import CaseRun
from .validate import check_case_run


@dataclass(frozen=True, eq=False)
class Ran:
    """A case's cached run (``run``), or why the engine says it does not apply (``not_applicable``)."""

    run: CaseRun | None
    seconds: float
    not_applicable: str | None = None


def run_case(plan: CheckPlan, case: Case) -> Ran:
    t0 = time.perf_counter()
    try:
        raw = plan.adapter.run_case(case, plan.tokens)
    except NotApplicable as exc:  # the adapter's own word that the case does not apply
        return Ran(None, time.perf_counter() - t0, str(exc))
    seconds = time.perf_counter() - t0
    return Ran(check_case_run(plan.adapter, plan.tier, plan.cfg, case, raw), seconds)
