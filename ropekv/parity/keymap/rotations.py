"""The rotations a fit tries: the contract's, and the alternatives a bug would have used instead.

A :class:`Rotation` turns raw vectors ``[cells, D]`` to positions ``[cells, S]`` (one per M-RoPE
section). Index 0 of every list is the contract's (the layer's own spec at the decode's length); the
alternatives are, where they differ from it: the other pairing (neox / gptj), the other layers'
specs (local / global RoPE, a NoPE layer's neighbours), all channels turned (partial rotary), the
frequencies of every earlier length (dynamic NTK, LongRoPE's short and long factors), angles computed
in bfloat16 or float16, and frequencies estimated from the tokens nothing else explains
(:mod:`.frequencies`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from ...rope import RopeSpec, apply_rotation

RotationKind = Literal["contract", "layout", "layer", "whole_head", "length", "precision", "estimated"]
Turn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (raw [cells, D], positions [cells, S]) -> [cells, D]
MAX_LENGTHS = 256  # earlier lengths a length-dependent RoPE is tried at


@dataclass(frozen=True, eq=False)
class Rotation:
    """One way to turn a token: ``name`` (for the evidence: "the gptj pairing", "frequencies for
    length 70"), ``kind``, ``turn`` and numbers for the report (``details``)."""

    name: str
    kind: RotationKind
    turn: Turn
    details: Mapping[str, object] = field(default_factory=dict)
    spec: RopeSpec | None = None  # the spec it turns under, where it is one


def _positions_arg(spec: RopeSpec, positions: torch.Tensor) -> torch.Tensor:
    """``[cells, S]`` as a spec's ``angles`` takes them: ``[cells]``, or the streams ``[3, cells]``."""
    if spec.mrope_section is not None and positions.shape[1] == 3:
        return positions.T.contiguous()
    return positions[:, 0]


def spec_rotation(spec: RopeSpec | None, seq_len: int, name: str, kind: RotationKind, **details: object) -> Rotation:
    """``spec`` at ``seq_len`` (None: a layer without position embedding, which turns nothing)."""

    def turn(raw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if spec is None:
            return raw
        return spec.rotate(raw[:, None, :], _positions_arg(spec, positions), seq_len)[:, 0, :]

    return Rotation(name, kind, turn, dict(details), spec)


def angle_rotation(spec: RopeSpec, name: str, kind: RotationKind, angles: Turn, **details: object) -> Rotation:
    """``spec``'s pairing and attention factor with angles ``angles(positions [cells, S]) -> [cells, n]``."""

    def turn(raw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ang = angles(positions, raw)
        a = spec.attention_factor
        out = apply_rotation(raw[:, None, :], torch.cos(ang) * a, torch.sin(ang) * a, spec.layout, spec.rotary_offset)
        return out[:, 0, :]

    return Rotation(name, kind, turn, dict(details), spec)


def pair_positions(spec: RopeSpec, positions: torch.Tensor) -> torch.Tensor:
    """The position each pair turns by, ``[cells, n]``, from ``[cells, S]``."""
    if positions.shape[1] == 1:
        return positions.expand(-1, spec.rotary_dim // 2)
    return positions[:, spec.section_axes()]


def frequency_rotation(spec: RopeSpec, w: torch.Tensor, name: str, kind: RotationKind, **details: object) -> Rotation:
    """``spec`` with its frequencies replaced by ``w [n]``."""
    return angle_rotation(
        spec, name, kind, lambda p, _raw: pair_positions(spec, p).to(torch.float64) * w[None, :], **details
    )


def precision_rotations(spec: RopeSpec, seq_len: int, dtype: torch.dtype) -> tuple[Rotation, ...]:
    """The three ways an engine turns with ``dtype`` (bfloat16, float16) tables: angles computed as
    ``position x inv_freq`` in ``dtype`` (the position itself rounds past the format's integers: 256 in
    bfloat16, 2048 in float16), exact angles rounded to ``dtype``, and cos/sin tables stored in ``dtype``."""
    w = spec.inv_freq(seq_len)
    name = str(dtype).replace("torch.", "")

    def computed(p: torch.Tensor, _raw: torch.Tensor) -> torch.Tensor:
        return (pair_positions(spec, p).to(dtype) * w.to(dtype)[None, :]).to(torch.float64)

    def rounded(p: torch.Tensor, _raw: torch.Tensor) -> torch.Tensor:
        return (pair_positions(spec, p).to(torch.float64) * w[None, :]).to(dtype).to(torch.float64)

    def tables(raw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ang = pair_positions(spec, positions).to(torch.float64) * w[None, :]
        a = spec.attention_factor
        cos = (torch.cos(ang) * a).to(dtype).to(torch.float64)
        sin = (torch.sin(ang) * a).to(dtype).to(torch.float64)
        return apply_rotation(raw[:, None, :], cos, sin, spec.layout, spec.rotary_offset)[:, 0, :]

    return (
        angle_rotation(spec, f"angles computed in {name}", "precision", computed, angle_dtype=name, form="computed"),
        angle_rotation(spec, f"angles rounded to {name}", "precision", rounded, angle_dtype=name, form="rounded"),
        Rotation(f"cos/sin tables in {name}", "precision", tables, {"angle_dtype": name, "form": "tables"}, spec),
    )


def alternatives(
    rope: RopeSpec | None,
    seq_len: int,
    others: tuple[tuple[str, RopeSpec | None], ...],
) -> tuple[Rotation, ...]:
    """The contract's rotation, then every alternative that computes something else for this layer
    (duplicates of an earlier one dropped). ``others``: the other layers' specs with a name each."""
    out = [spec_rotation(rope, seq_len, "the contract's RoPE", "contract")]
    if rope is not None:
        other = "gptj" if rope.layout == "neox" else "neox"
        out.append(spec_rotation(rope.replace(layout=other), seq_len, f"the {other} pairing", "layout", layout=other))
    for name, spec in others:
        if spec is None or (rope is not None and spec == rope):
            continue
        if rope is not None and (spec.head_dim != rope.head_dim):
            continue
        out.append(spec_rotation(spec, seq_len, name, "layer", theta=spec.theta, rope_type=spec.scaling.rope_type))
    if rope is None:
        return tuple(out)
    if rope.rotary_dim < rope.head_dim and rope.scaling.short_factor is None:
        whole = rope.replace(rotary_dim=rope.head_dim, rotary_offset=0)
        out.append(spec_rotation(whole, seq_len, f"all {rope.head_dim} channels turned", "whole_head"))
    if rope.length_dependent:
        orig = rope.scaling.original_max_position_embeddings or rope.max_position_embeddings
        now = rope.inv_freq(seq_len)
        lengths = list(range(min(orig, seq_len), seq_len))
        if rope.scaling.rope_type == "longrope":
            lengths = [orig, orig + 1]  # its two factor sets: short up to the original length, long past it
        if len(lengths) > MAX_LENGTHS:
            pick = torch.linspace(0, len(lengths) - 1, MAX_LENGTHS).round().long().tolist()
            lengths = sorted({lengths[i] for i in pick})
        for n in lengths:
            w = rope.inv_freq(n)
            if torch.equal(w, now):
                continue
            label = f"the frequencies for length {n}"
            if rope.scaling.rope_type == "longrope":
                label = f"LongRoPE's {'short' if n <= orig else 'long'} factors"
            out.append(frequency_rotation(rope, w, label, "length", seq_len=n))
    for dtype in (torch.bfloat16, torch.float16):
        out.extend(precision_rotations(rope, seq_len, dtype))
    return tuple(out)
