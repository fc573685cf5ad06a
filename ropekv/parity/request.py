"""What a check is asked to do: one typed request instead of a long list of keywords.

:class:`CheckRequest` holds the engine, the cases (or the options of the default matrix), the
reference, the tolerances, the reference cache and the bug-class explanations the diagnosis tries;
:func:`ropekv.parity.harness.run_check` carries it through the stages (plan, run, judge, diagnose,
report). ``ropekv.check(...)`` and the CLI build one from their keywords and flags.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import UsageError
from .cases import Case
from .compare import Tolerance
from .explain.evidence import Explanation
from .protocol import EngineAdapter
from .reference_cache import ReferenceStore

REFERENCE_DTYPES = ("float64", "float32")  # names in ropekv.contract.DTYPES the reference decoder runs in
PROGRESS_MODES = (False, True, "bar", "lines", "off")


@dataclass(frozen=True)
class MatrixOptions:
    """The default matrix's knobs, as the CLI flags of the same name (None: the default)."""

    lengths: tuple[int, ...] | None = None
    block_sizes: tuple[int, ...] | None = None
    prefix_offsets: tuple[int, ...] | None = None
    window: int | None = None
    sink_tokens: int = 0
    chunk: int | None = None
    decode_steps: int | None = None


@dataclass(frozen=True, eq=False)
class CheckRequest:
    """One check. ``engine``: the adapter; ``cases``: the cases to run (None: the matrix of
    ``matrix``); ``dtype``/``key_form``/``backend``: what the caller expects the adapter to run
    (checked, never changed); ``tolerance``: replaces the per-dtype tolerance; ``reference_cache``:
    a folder or store the float64 rows are kept in; ``explanations``: the bug classes the diagnosis
    tries, in order (empty: the key map is described, no class is named)."""

    engine: EngineAdapter
    cases: tuple[Case, ...] | None = None
    matrix: MatrixOptions = MatrixOptions()
    dtype: str | None = None
    key_form: str | None = None
    backend: str | None = None
    reference: str = "float64"
    seed: int = 0
    progress: bool | str = False
    tolerance: Tolerance | None = None
    reference_cache: str | os.PathLike[str] | ReferenceStore | None = None
    explanations: tuple[Explanation, ...] = ()

    def __post_init__(self) -> None:
        if self.reference not in REFERENCE_DTYPES:
            raise UsageError(f"reference must be one of {', '.join(REFERENCE_DTYPES)}, got {self.reference!r}")
        if self.progress not in PROGRESS_MODES:
            raise UsageError(f"progress must be one of {PROGRESS_MODES}, got {self.progress!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise UsageError(f"seed must be an integer, got {self.seed!r}")
        if self.tolerance is not None and not isinstance(self.tolerance, Tolerance):
            raise UsageError(f"tolerance must be a Tolerance, got {type(self.tolerance).__name__}")
        if not all(isinstance(e, Explanation) for e in self.explanations):
            raise UsageError("explanations must be Explanation records (ropekv.bugs.registry.EXPLANATIONS)")
        if self.cases is not None and not all(isinstance(c, Case) for c in self.cases):
            bad = next(c for c in self.cases if not isinstance(c, Case))
            raise UsageError(f"cases must be Case records, got {type(bad).__name__}")
