"""M-RoPE axes faults: the cached path turns image-like tokens with their height and width streams
replaced by the temporal one (one position per token). Text positions hide both (t = h = w there);
they show only on a case with image-like positions (``Case.image``), which ``exposing`` holds."""

from __future__ import annotations

import dataclasses

import torch

from ..engine.rotation import RotationPolicy, StepContext
from ..models.config import ModelConfig
from ..parity.cases import Case, ImageGrid
from ..rope import RopeSpec
from .native import NativeFault


def _collapsed(ctx: StepContext) -> StepContext:
    """``ctx`` with h and w at t, on the cached path only (the engine's own full forward stays right)."""
    if not ctx.cached or ctx.streams is None:
        return ctx
    return dataclasses.replace(ctx, streams=ctx.streams.collapsed())


class MropeAxesCollapsed(RotationPolicy):
    """Queries and keys of the cached path turn every section with the t stream."""

    name = "mrope-axes-collapsed"

    def query(self, rope: RopeSpec | None, q: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return super().query(rope, q, positions, _collapsed(ctx))

    def write_key(
        self, rope: RopeSpec | None, k: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        return super().write_key(rope, k, positions, slots, _collapsed(ctx))

    def read_keys(
        self,
        rope: RopeSpec | None,
        stored: torch.Tensor,
        rotation_index: torch.Tensor,
        slots: torch.Tensor,
        ctx: StepContext,
        *,
        backend_rotates: bool,
    ) -> torch.Tensor:
        return super().read_keys(rope, stored, rotation_index, slots, _collapsed(ctx), backend_rotates=backend_rotates)


class MropeHwOverwrittenByT(RotationPolicy):
    """Queries keep their streams; the cache's keys (turned when written, or when read back from the
    cache by a rotating reader) have their h and w streams overwritten by t."""

    name = "mrope-hw-overwritten-by-t"

    def write_key(
        self, rope: RopeSpec | None, k: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        return super().write_key(rope, k, positions, slots, _collapsed(ctx))

    def read_keys(
        self,
        rope: RopeSpec | None,
        stored: torch.Tensor,
        rotation_index: torch.Tensor,
        slots: torch.Tensor,
        ctx: StepContext,
        *,
        backend_rotates: bool,
    ) -> torch.Tensor:
        return super().read_keys(rope, stored, rotation_index, slots, _collapsed(ctx), backend_rotates=backend_rotates)


def _has_mrope(cfg: ModelConfig) -> bool:
    return any((r := cfg.layer_rope(i)) is not None and r.mrope_section is not None for i in range(cfg.num_layers))


# A 4x4 image after 5 text tokens, then text; and a 3x5 image inside a prefix-cache hit, chunked.
EXPOSING = (
    Case(length=26, block_size=7, decode_steps=2, image=ImageGrid(start=5, rows=4, cols=4)),
    Case(length=14, prefix=11, block_size=5, chunk=6, decode_steps=2, image=ImageGrid(start=3, rows=3, cols=5)),
)
NEEDS = "M-RoPE (qwen2_vl, qwen2_5_vl)"

CATALOGUE = (
    NativeFault(
        name="mrope-axes-collapsed",
        kind="mrope_axes_collapsed",
        description="the cached path turns every M-RoPE section with the t stream (one position per token)",
        key_form="rotated",
        shows_when="image-like positions (a case with an image grid)",
        rotation=MropeAxesCollapsed,
        needs=NEEDS,
        applies=_has_mrope,
        exposing=EXPOSING,
    ),
    NativeFault(
        name="mrope-hw-overwritten-by-t",
        kind="mrope_axes_collapsed",
        description="the cache's keys have their M-RoPE h/w streams overwritten by t (queries right)",
        key_form="rotated",
        shows_when="image-like positions (a case with an image grid)",
        rotation=MropeHwOverwrittenByT,
        needs=NEEDS,
        applies=_has_mrope,
        exposing=EXPOSING,
    ),
)
