"""The adapter protocol the parity harness drives, in three tiers, and its one probe record.

An adapter declares the highest :class:`Tier` it supports; the harness does everything that tier
allows and says in the report what it cannot conclude:

- ``logits``: next-token logits (or top-k log-probabilities) of each decode step after the cached
  path, and the engine's own cache-free forward at the same rows. Detects a divergence and the first
  diverging step.
- ``attention``: adds, per layer, the query and the keys as the kernel used them, the keys' logical
  positions (from the engine's own metadata) and slots. ropekv computes the attention logits itself
  from them (:func:`ropekv.parity.recorder.attention_logits`), so adapters never build logits. Gives
  the first divergent layer.
- ``forensics``: the same records, with the promise that ``q``/``k`` are exactly what the kernel
  multiplied (after whatever rotation the engine applies). ropekv recomputes the raw keys with its
  float64 reference and names the bug class.

Every adapter result is validated against its case before anything is compared
(:mod:`ropekv.parity.validate`); a violation raises :class:`~ropekv.errors.AdapterError`.
See docs/adapters.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import UsageError
from ..models.config import Checkpoint
from ..probe import LayerProbe
from .cases import Case

__all__ = ["Tier", "LayerProbe", "StepRecord", "CaseRun", "FullRun", "EngineDescription", "Ignored", "EngineAdapter"]


class Tier(StrEnum):
    LOGITS = "logits"
    ATTENTION = "attention"
    FORENSICS = "forensics"

    @property
    def rank(self) -> int:
        return list(Tier).index(self)

    def __ge__(self, other: Tier) -> bool:  # type: ignore[override]
        return self.rank >= Tier(other).rank

    def __lt__(self, other: Tier) -> bool:  # type: ignore[override]
        return self.rank < Tier(other).rank


@dataclass(frozen=True, eq=False)
class StepRecord:
    """One decode step of the cached path.

    ``logits`` is ``[vocab]`` full next-token logits, or, where the engine only exposes top-k
    log-probabilities (vLLM), ``[K]`` log-probabilities at ``token_ids [K]``.
    """

    position: int  # logical position t of the decoded token (its query row)
    logits: torch.Tensor  # [vocab] logits, or [K] log-probabilities at token_ids
    token_ids: torch.Tensor | None = None  # [K] int64, only for top-k log-probabilities
    layers: tuple[LayerProbe, ...] = ()  # one per layer at the attention tier and above, R = 1


@dataclass(frozen=True, eq=False)
class CaseRun:
    """The cached path of one case: one record per decode step."""

    steps: tuple[StepRecord, ...]
    handoff_len: int = 0  # tokens that crossed a prefill->decode handoff (0 = none)
    notes: tuple[str, ...] = ()  # engine facts for the report ("vLLM took 32 prompt tokens from its prefix cache")


@dataclass(frozen=True, eq=False)
class FullRun:
    """The engine's own cache-free forward over ``T`` tokens, probed at ``rows``."""

    rows: torch.Tensor  # [R] int64 positions probed
    logits: torch.Tensor  # [R, vocab] logits, or [R, K] log-probabilities at token_ids
    token_ids: torch.Tensor | None = None  # [R, K] int64, only for top-k log-probabilities
    layers: tuple[LayerProbe, ...] = ()  # per layer: q [R, H, D] at rows, k [T, KVH, D], key_positions [T]


@dataclass(frozen=True)
class EngineDescription:
    """What an engine says about itself: the facts the harness reads, typed, and the rest for the report.

    ``key_form`` and ``backend`` are checked against what a caller asks for (``ropekv.check(key_form=...)``)
    and ``key_form`` ("rotated" or "raw") shapes the cache-operation hypotheses; ``ops`` names the cache
    operations (``ropekv.parity.cases.OP_KINDS``) the engine runs, and no others run on it. ``extra``
    holds the engine-specific facts that are only written to the report's JSON ``"engine"`` object
    (json-able values: contract, versions, dtype, ...). None and an empty ``ops`` are left out of it.
    """

    name: str | None = None
    key_form: str | None = None
    backend: str | None = None
    ops: tuple[str, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for f in ("name", "key_form", "backend"):
            value = getattr(self, f)
            if value is not None and not isinstance(value, str):
                raise UsageError(f"EngineDescription.{f} must be a string or None, got {value!r}")
        if not isinstance(self.ops, tuple) or not all(isinstance(k, str) for k in self.ops):
            raise UsageError(f"EngineDescription.ops must be a tuple of cache operation names, got {self.ops!r}")
        if not isinstance(self.extra, Mapping) or not all(isinstance(k, str) for k in self.extra):
            raise UsageError(f"EngineDescription.extra must be a mapping with string keys, got {self.extra!r}")
        typed = sorted(set(self.extra) & {"name", "key_form", "backend", "ops"})
        if typed:
            raise UsageError(f"EngineDescription.extra must not hold the typed fields {', '.join(typed)}")

    def to_dict(self) -> dict[str, Any]:
        """The report's JSON ``"engine"`` object."""
        out: dict[str, Any] = {
            k: v
            for k, v in (("name", self.name), ("key_form", self.key_form), ("backend", self.backend))
            if v is not None
        }
        out.update(self.extra)
        if self.ops:
            out["ops"] = list(self.ops)
        return out


@dataclass(frozen=True)
class Ignored:
    """A case parameter an engine cannot honour, and the note the report prints for it.

    ``param`` names it ("block_size", "window", "chunk", "op", ...); ``text`` is the note as the report
    prints and writes it ("block_size=4 (vLLM runs 16)"), the parameter's name where none is given.
    """

    param: str
    text: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.param, str) or not self.param:
            raise UsageError(f"Ignored.param must be a case parameter's name, got {self.param!r}")
        if not isinstance(self.text, str):
            raise UsageError(f"Ignored.text must be a string, got {self.text!r}")
        if not self.text:
            object.__setattr__(self, "text", self.param)


@runtime_checkable
class EngineAdapter(Protocol):
    """What ``ropekv.check`` needs from an engine. ``tier`` is the highest tier it supports."""

    name: str
    tier: Tier
    checkpoint: Checkpoint  # the model as this engine runs it (config with its RoPE, weights)
    dtype: torch.dtype  # the dtype the engine computes in (sets the tolerance)

    def describe(self) -> EngineDescription:
        """Facts for the harness and the report (contract as the engine runs it, backend, key form, ...)."""

    def ignored(self, case: Case) -> tuple[Ignored, ...]:
        """Case parameters this engine cannot honour (reported in the report, never silently dropped)."""

    def run_case(self, case: Case, tokens: torch.Tensor) -> CaseRun:
        """Prefix hit, prefill, then ``case.decode_steps`` decode steps over ``tokens [>= case.total]``."""

    def full_forward(self, tokens: torch.Tensor, rows: list[int], case: Case) -> FullRun:
        """The engine's own full forward over ``tokens [T]`` with the case's window, probed at ``rows``."""


REQUIRED_MEMBERS = ("name", "tier", "checkpoint", "dtype", "describe", "ignored", "run_case", "full_forward")
