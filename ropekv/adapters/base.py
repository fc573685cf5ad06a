"""The protocol the parity harness drives. Any engine that implements it can be checked.

An adapter runs the cached path of a :class:`~ropekv.parity.cases.Case` and the engine's own full
forward, and reports, for each decoded token and layer, what its attention kernel saw: the layer's
input, the query and keys as the kernel used them, the keys' logical positions and slots, and the
pre-softmax logits. The harness compares those with the engine's full forward (self-parity) and with
ropekv's float64 reference decoder built from ``adapter.checkpoint`` (independent parity).
See docs/adapters.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ..models.config import Checkpoint
from ..parity.cases import Case


@dataclass(frozen=True, eq=False)
class LayerView:
    """One layer of one decode step, as the engine's kernel saw it."""

    hidden_in: torch.Tensor  # [hidden]
    attn_logits: torch.Tensor  # [H, N] pre-softmax, scaled, masked -inf
    key_positions: torch.Tensor  # [N] logical positions of the keys in attn_logits' last dim
    key_slots: torch.Tensor  # [N] physical slot of each key (-1 where the engine has no slots)
    q_eff: torch.Tensor | None = None  # [H, D] query as the kernel used it (for forensics)
    k_eff: torch.Tensor | None = None  # [N, KVH, D] keys as the kernel used them (for forensics)


@dataclass(frozen=True, eq=False)
class StepTrace:
    position: int  # logical position t of the decoded token (its query row)
    logits: torch.Tensor  # [vocab] next-token logits
    layers: tuple[LayerView, ...]


@dataclass(frozen=True, eq=False)
class CaseRun:
    steps: tuple[StepTrace, ...]
    handoff_len: int = 0  # tokens that crossed a prefill->decode handoff (0 = none)


@dataclass(frozen=True, eq=False)
class FullRun:
    """The engine's own cache-free forward, probed at ``rows``."""

    rows: torch.Tensor  # [R]
    logits: torch.Tensor  # [R, vocab]
    hidden_in: tuple[torch.Tensor, ...]  # per layer [R, hidden]
    attn_logits: tuple[torch.Tensor, ...]  # per layer [H, R, T]


@runtime_checkable
class EngineAdapter(Protocol):
    """What ``ropekv.check`` needs from an engine."""

    name: str
    checkpoint: Checkpoint  # the model as this engine runs it (config with its RoPE, weights)
    dtype: torch.dtype

    def describe(self) -> dict[str, Any]:
        """JSON-able facts for the report (contract, backend, key form, ...)."""

    def ignored(self, case: Case) -> tuple[str, ...]:
        """Case parameters that do not apply to this engine (reported, not an error)."""

    def run_case(self, case: Case, tokens: torch.Tensor) -> CaseRun:
        """Prefix hit, prefill, then ``case.decode_steps`` decode steps over ``tokens [>= case.total]``."""

    def full_forward(self, tokens: torch.Tensor, rows: list[int], case: Case) -> FullRun:
        """The engine's own full forward over ``tokens [T]`` with the case's window, probed at ``rows``."""
