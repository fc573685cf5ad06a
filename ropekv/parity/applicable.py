"""Whether a parity case applies to a model and an engine, and if not, why.

A case that cannot apply is reported as ``n/a`` with the reason and not judged (docs/report.md);
the others are. A case does not apply when

- the model is too short for it (its highest position is past the model's limit);
- its cache operation is one the engine does not run (``describe().ops``), or one the model's RoPE
  forbids (a shift of a RoPE that is not shift-invariant), or one the model's own windows leave no
  room for (an eviction when the window keeps fewer interior tokens than it evicts);
- the engine ignores a parameter of it that changes the expected output (:data:`CHANGES_OUTPUT`:
  the window, the sinks, the operation). A parameter that only changes the path to the same output
  (the block size, the prefill chunk, a prefix served by prefill) is noted and the case is judged.

What is refused here is only "this case does not apply"; an engine that fails while running an
applicable case fails loudly, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..cache.ops import shift_invariant
from ..models.config import ModelConfig
from .cases import Case, OpKind, too_long
from .protocol import EngineDescription, Ignored

CHANGES_OUTPUT = frozenset({"window", "sink_tokens", "op", "length", "decode_steps"})
"""Case parameters whose value changes what the reference expects: an engine that ignores one of them
runs another case than the one judged, so the case is not applicable to it. Any other parameter an
engine ignores (``block_size``, ``chunk``, ``prefix``, engine settings such as ``cache``) leaves the
expected output as it is: it is noted in the report and the case is judged."""


@dataclass(frozen=True)
class Applicability:
    """A case as it meets a model and an engine: the ignored parameters it is judged without (``noted``),
    and the reason it is not applicable (None: it is judged)."""

    case: Case
    noted: tuple[Ignored, ...]
    not_applicable: str | None


def applicability(
    case: Case, cfg: ModelConfig, engine: EngineDescription, ignored: tuple[Ignored, ...]
) -> Applicability:
    """Whether ``case`` (already :meth:`Case.for_model`) applies to the model ``cfg`` and an engine that
    describes itself as ``engine`` and ignores ``ignored`` of the case's parameters."""
    changing = [x for x in ignored if x.param in CHANGES_OUTPUT]
    noted = tuple(x for x in ignored if x.param not in CHANGES_OUTPUT)
    why = too_long(case, cfg.position_limit)
    if why is None and changing:
        why = "ignored for this engine: " + ", ".join(x.text for x in changing) + " (the expected output depends on it)"
    if why is None and case.op is not None:
        why = _op_reason(case, cfg, engine)
    if why is None and case.image is not None and cfg.rope.mrope_section is None:
        why = f"image-like positions ({case.image.label()}) need an M-RoPE model; {cfg.architecture} has none"
    return Applicability(case, noted, why)


def _op_reason(case: Case, cfg: ModelConfig, engine: EngineDescription) -> str | None:
    op = case.op
    if op is None:
        return None
    if op.kind not in engine.ops:
        declared = ", ".join(engine.ops) or "no cache operations"
        return f"engine {engine.name or 'adapter'!r} does not run {op.kind} (it declares {declared})"
    if op.kind == OpKind.SHIFT and not shift_invariant(cfg.rope):
        return (
            f"shift: {'M-RoPE' if cfg.rope.mrope_section else cfg.rope.scaling.rope_type} RoPE is not shift-invariant (frequencies that depend on the "
            "length, or positions per section): no cache can be shifted exactly"
        )
    return case.evict_shortfall(case.live_window)
