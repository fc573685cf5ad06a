"""The one probe record: what an attention kernel saw for some query rows of one layer.

It sits at the bottom of the package (it imports only torch) because every layer produces it: the
float64 reference decoder, ropekv's engine, the shared attention recorder and every engine adapter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class LayerProbe:
    """One layer at ``R`` probed query rows, as the attention kernel used it: the one record shared by
    ropekv's engine, its float64 reference decoder and every adapter.

    For a decode step ``R = 1`` and ``k`` holds exactly the keys the kernel attended to. For a full
    forward ``k`` holds every key of the sequence (``N = T``) and ropekv masks by positions.
    """

    q: torch.Tensor  # [R, H, D] query as the kernel used it (after RoPE where the engine rotates)
    k: torch.Tensor  # [N, KVH, D] keys as the kernel used them
    key_positions: torch.Tensor  # [N] int64 logical positions, from the engine's own metadata
    key_slots: torch.Tensor | None = None  # [N] int64 physical slot of each key, -1 where none
    hidden_in: torch.Tensor | None = None  # [R, hidden] the layer's input (residual stream)
    q_raw: torch.Tensor | None = None  # [R, H, D] before RoPE, where the engine has it
    k_raw: torch.Tensor | None = None  # [N, KVH, D] before RoPE, where the engine has it
    v: torch.Tensor | None = None  # [N, KVH, D]
