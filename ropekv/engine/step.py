"""The records of one engine step: its rows (one per sequence), each kind's share of a row, probes.

A step is the tokens ``[n]`` the engine runs through every layer at once. A prefill chunk, a decode
step and the cache-free forward are one row; a batched decode is ``B`` rows of one token each (one
per sequence, each at its own next position, ``Engine.decode_batch``). Every layer treats each row
with the same code (``Engine._attend_row``); only a batch's attention then runs over all rows at
once (:func:`~ropekv.engine.attention.attend_padded`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from ..attention_kind import LayerAttention
from ..probe import LayerProbe
from .rotation import StepContext


@dataclass(frozen=True, eq=False)
class StepGroup:
    """One attention kind's share of a row (see ``Engine._step_groups``)."""

    new_slots: torch.Tensor  # [n] slots of the row's tokens
    key_pos: torch.Tensor  # [N + n] positions of every key the row's queries may read
    key_slots: torch.Tensor  # [N + n]
    mask: torch.Tensor  # [n, N + n] visibility
    attn_mask: torch.Tensor | None  # the mask, or None when it hides nothing
    segments: bool  # read the cached keys in place (attend_segments) instead of joining them
    read_positions: torch.Tensor  # positions of the keys a rotating read turns in one call


@dataclass(frozen=True, eq=False)
class StepRow:
    """One sequence's share of a step: its tokens' rows, positions, context and per-kind groups."""

    seq_id: Hashable | None  # None: the cache-free forward
    tokens: slice  # the row's tokens among the step's [n]
    positions: torch.Tensor  # [n_r] logical positions
    ctx: StepContext
    groups: dict[LayerAttention, StepGroup]


def layer_probe(
    rows: list[int],
    h: torch.Tensor,
    q: torch.Tensor,
    q_eff: torch.Tensor,
    k_eff: torch.Tensor,
    values: torch.Tensor,
    key_pos: torch.Tensor,
    key_slots: torch.Tensor,
    mask: torch.Tensor,
) -> LayerProbe:
    """The layer as its kernel saw it at ``rows``. One row (a decode step, or a per-position full
    forward): exactly the keys the kernel attended to, by the engine's own mask. Several rows (a probed
    full forward): every key, and the reader masks by position.

    The probe's tensors are its own: ``values`` (and raw keys) are views of the layer's fused qkv
    projection, and a probe holding such a view would keep the whole projection alive for as long as
    the check keeps the forward (at 32,766 tokens of Gemma 3 270M, 201 MB a layer for 34 MB of values)."""
    r = torch.as_tensor(rows)
    if len(rows) == 1:
        keep = mask[r[0]]  # a boolean index: copies
        k, v, kpos, kslots = k_eff[keep], values[keep], key_pos[keep], key_slots[keep]
    else:
        k, v, kpos, kslots = k_eff.contiguous(), values.contiguous(), key_pos, key_slots
    return LayerProbe(
        q=q_eff[r],
        k=k,
        key_positions=kpos,
        key_slots=kslots,
        hidden_in=h[r].detach(),
        q_raw=q[r],
        v=v,
    )


def query_row(probe: LayerProbe, i: int, visible: torch.Tensor) -> LayerProbe:
    """Row ``i`` of a probe of several rows over every key (``visible [N]``: that row's mask), as a
    decode step's probe: its query and exactly the keys it attended to."""
    return LayerProbe(
        q=probe.q[i : i + 1],
        k=probe.k[visible],
        key_positions=probe.key_positions[visible],
        key_slots=None if probe.key_slots is None else probe.key_slots[visible],
        hidden_in=None if probe.hidden_in is None else probe.hidden_in[i : i + 1],
        q_raw=None if probe.q_raw is None else probe.q_raw[i : i + 1],
        k_raw=None if probe.k_raw is None else probe.k_raw[visible],
        v=None if probe.v is None else probe.v[visible],
    )
