"""What a cache operation does to stored keys: the correct behaviour, as a policy object.

:class:`CacheOpPolicy` decides the two places where an operation touches key *contents* (everything
else an operation does is bookkeeping of positions and slots): what a rolled-back ring slot gets back,
how a shift turns stored keys, what the rows written into a block copied on write hold, and (an
8-bit cache) which scales dequantize the rows a read returns. Faults (``ropekv.bugs``: each bug class's module) are small subclasses handed
to the cache, the way rotation faults subclass :class:`~ropekv.engine.rotation.RotationPolicy`, so the cache
itself has no fault switches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..rope import RopeSpec, apply_rotation
from .quant import LayerScales


class CacheOpPolicy:
    """Correct: a ring gets back what the rejected tokens overwrote; rotated keys turn by R(delta) once
    (in float32 or wider), raw keys are only relabelled."""

    name = "correct"

    def ring_restore(self, journal: torch.Tensor, current: torch.Tensor, *, age: int) -> torch.Tensor:
        """Content ``[k, KVH, D]`` a rolled-back ring slot holds afterwards: the journal's copy of the
        token the rejected one overwrote (``current`` is the rejected token's own key or value).
        ``age``: 0 for the newest rejected token, counting back (restores run newest first)."""
        return journal

    def survivor_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Positions ``[N]`` the tokens surviving an eviction hold afterwards (``positions`` theirs
        before, in write order; groups without a ring only): their own, unchanged."""
        return positions

    def copied_block_rows(self, written: torch.Tensor, stored: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        """Content ``[k, KVH, D]`` of rows an append writes into a block it has just copied on write (the
        partial block of a prefix-cache hit): the new tokens' own keys or values ``written``. ``stored``:
        what the copy brought from the shared block at those rows; ``held [k]`` bool: rows where that
        block held a token (the earlier request's continuation past the hit)."""
        return written

    def read_scales(
        self, layer: int, scales: Sequence[LayerScales | None], inherited: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value scales (``[S]``, or ``[N, S]`` one per row) that dequantize the ``N`` rows
        a read of ``layer`` in an 8-bit cache returns: that layer's own (``scales[layer]``).
        ``inherited [N]`` bool: rows the sequence reused from a prefix-cache hit."""
        s = scales[layer]
        assert s is not None, "a read of a written layer: its scales are set"
        return s.k, s.v

    def quantized_keys(self, rope: RopeSpec | None, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The keys ``[k, KVH, D]`` an 8-bit cache quantizes for rows at ``positions [k]``: the keys it
        was handed, in the contract's key form (rotated keys after RoPE, raw keys before it).
        ``rope``: the layer's spec (None: a layer without position embedding)."""
        return keys

    def shift_keys(self, rope: RopeSpec, keys: torch.Tensor, delta: int, key_form: str) -> torch.Tensor:
        """Stored keys ``[N, KVH, D]`` after their positions moved by ``delta``."""
        if key_form == "raw":
            return keys
        return turn(rope, keys, delta)


def turn(rope: RopeSpec, keys: torch.Tensor, delta: int) -> torch.Tensor:
    """``R(delta) keys`` for keys ``[N, KVH, D]`` already rotated: angles ``delta * inv_freq`` from
    float64, the product in float32 (float64 for float64 keys), the attention factor not applied
    again (it was applied once when the keys were first rotated). Result in ``keys``' dtype."""
    n = keys.shape[0]
    ang = rope.angles(torch.full((n,), int(delta), dtype=torch.int64))  # [N, rotary_dim / 2] float64
    return apply_rotation(keys, torch.cos(ang), torch.sin(ang), rope.layout, rope.rotary_offset)


CORRECT = CacheOpPolicy()
