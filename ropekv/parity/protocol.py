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

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

import torch

from ..models.config import Checkpoint
from ..probe import LayerProbe
from .cases import Case

__all__ = ["Tier", "LayerProbe", "StepRecord", "CaseRun", "FullRun", "EngineAdapter"]


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


@runtime_checkable
class EngineAdapter(Protocol):
    """What ``ropekv.check`` needs from an engine. ``tier`` is the highest tier it supports."""

    name: str
    tier: Tier
    checkpoint: Checkpoint  # the model as this engine runs it (config with its RoPE, weights)
    dtype: torch.dtype  # the dtype the engine computes in (sets the tolerance)

    def describe(self) -> dict[str, Any]:
        """JSON-able facts for the report (contract as the engine runs it, backend, key form, ...)."""

    def ignored(self, case: Case) -> tuple[str, ...]:
        """Case parameters this engine cannot honour (reported in the report, never silently dropped)."""

    def run_case(self, case: Case, tokens: torch.Tensor) -> CaseRun:
        """Prefix hit, prefill, then ``case.decode_steps`` decode steps over ``tokens [>= case.total]``."""

    def full_forward(self, tokens: torch.Tensor, rows: list[int], case: Case) -> FullRun:
        """The engine's own full forward over ``tokens [T]`` with the case's window, probed at ``rows``."""


REQUIRED_MEMBERS = ("name", "tier", "checkpoint", "dtype", "describe", "ignored", "run_case", "full_forward")
