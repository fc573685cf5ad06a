"""Where positions become rotations: the one place the engine turns positions into RoPE.

:class:`RotationPolicy` is the correct behaviour. Every bug class of the primer is a small subclass
that overrides one method (see ``ropekv.parity.faults``), so a fault is a named, reviewable variant
and the engine itself has no fault switches. Stored positions are always the logical truth; a policy
only decides how they turn queries and keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rope import RopeSpec


@dataclass(frozen=True)
class StepContext:
    """What a policy may know about the step in progress.

    ``phase`` is ``"prefill"`` (a chunk of new tokens), ``"decode"`` (one new token) or ``"full"``
    (the engine's own cache-free forward, used for self-parity). ``seq_len`` is the length the
    frequencies are computed for (length-dependent RoPE); ``fork_offset`` the prefix length the
    sequence was forked at (0 if it was not); ``block_size`` the cache's block size.
    """

    phase: str
    seq_len: int
    fork_offset: int = 0
    block_size: int = 1


class RotationPolicy:
    """Correct rotation: queries and keys turn at their logical positions (or cache indices)."""

    name = "correct"

    def query(self, rope: RopeSpec, q: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Rotate queries ``q [n, H, D]`` to their rotation indices ``positions [n]``."""
        return rope.rotate(q, positions, ctx.seq_len)

    def write_key(self, rope: RopeSpec, k: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                  ctx: StepContext) -> torch.Tensor:
        """The form a ``"rotated"`` cache stores for new raw keys ``k [n, KVH, D]``: rotated at ``positions``."""
        return rope.rotate(k, positions, ctx.seq_len)

    def read_keys(self, rope: RopeSpec, stored: torch.Tensor, rotation_index: torch.Tensor, slots: torch.Tensor,
                  ctx: StepContext, *, backend_rotates: bool) -> torch.Tensor:
        """Keys ``[N, KVH, D]`` as the kernel uses them, from the stored form.

        A rotating backend turns raw keys to ``rotation_index`` (logical positions, never ``slots``) in
        float32 or wider; a non-rotating backend reads rotated keys as stored.
        """
        if backend_rotates:
            work = stored if stored.dtype == torch.float64 else stored.float()
            return rope.rotate(work, rotation_index, ctx.seq_len)
        return stored
