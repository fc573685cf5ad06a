"""One synthetic decode row through ``ropekv.diagnose_row``, with the arguments the tests build rows
from (the raw and effective query ``[H, D]`` and keys ``[N, KVH, D]``, the query's position, the keys'
positions and slots) and the diagnosis's positions read back from its key map."""

from __future__ import annotations

import torch

from ropekv import diagnose_row
from ropekv.parity.cases import Case
from ropekv.parity.diagnosis import Diagnosis
from ropekv.rope import RopeSpec


def diagnose(
    spec: RopeSpec,
    q: torch.Tensor,
    q_eff: torch.Tensor,
    k: torch.Tensor,
    k_eff: torch.Tensor,
    t: int,
    positions: torch.Tensor,
    slots: torch.Tensor | None = None,
    *,
    case: Case | None = None,
    self_parity_passed: bool = False,
    dtype: str = "float32",
) -> Diagnosis:
    return diagnose_row(
        spec,
        q_raw=q,
        q_eff=q_eff,
        k_raw=k,
        k_eff=k_eff,
        query_position=t,
        key_positions=positions,
        key_slots=slots,
        case=case,
        self_parity_passed=self_parity_passed,
        dtype=dtype,
    )


def key_positions(d: Diagnosis) -> tuple[int | None, ...]:
    """Each key's effective position (every head agreeing) in the diagnosis's key map."""
    assert d.keymap is not None
    return tuple(d.keymap.keys.agreed())


def query_position(d: Diagnosis) -> int | None:
    assert d.keymap is not None
    return d.keymap.query.agreed()[0]
