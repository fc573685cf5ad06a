"""mrope_axes_collapsed: image-like keys whose M-RoPE sections turned by another stream's position.

Under M-RoPE (Qwen2-VL) a token's frequency pairs fall into sections turned by three streams (t, h,
w); text has them equal, an image token does not. A cached path that turns every section with one
stream (h and w collapsed to t), or swaps or overwrites one (w at h), still turns each section exactly,
at the wrong stream's position. The fit finds each section's position separately; the evidence says
which section took which stream, for which image keys.
"""

from __future__ import annotations

import dataclasses

import torch

from ..engine.rotation import RotationPolicy, StepContext
from ..faults.native import NativeFault
from ..models.config import ModelConfig
from ..parity.bug_class import BugClass
from ..parity.cases import Case, ImageGrid
from ..parity.explain.cells import Cells, rows_of, scope_of, share, span_text
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..rope import MROPE_AXES, RopeSpec

KIND = BugClass.MROPE_AXES_COLLAPSED


def explain(ev: CaseEvidence) -> Match | None:
    km = ev.keymap
    if km is None or km.keys.expected.shape[1] != 3:
        return None
    k = km.keys
    exp = k.expected  # [N, 3]
    image = (exp != exp[:, :1]).any(1)  # tokens whose streams differ
    if not bool(image.any()):
        return None
    eff = k.effective  # [N, K, 3]
    base = k.ok & k.own_content & (k.rotation == 0)
    # for each section s and stream a: the cells whose section s sits at stream a's position
    took = torch.stack([torch.stack([eff[..., s] == exp[:, a, None] for a in range(3)], -1) for s in range(3)], -2)
    # [N, K, 3 sections, 3 streams]; a mapping per section: the stream most image cells' section took
    mapping = []
    img_cells = base & image[:, None]
    for s in range(3):
        votes = took[..., s, :][img_cells].sum(0) if bool(img_cells.any()) else torch.zeros(3)
        # prefer the section's own stream on a tie (no change)
        votes = votes.double()
        votes[s] += 0.5
        mapping.append(int(votes.argmax()))
    if mapping == [0, 1, 2]:
        return None
    predicted = exp[:, mapping]  # [N, 3] where each section should sit under the mapping
    cells_k = base & (eff == predicted[:, None, :]).all(-1) & image[:, None]
    if not bool(cells_k.any()):
        return None
    cells = Cells(cells_k, torch.zeros(km.query.heads, dtype=torch.bool))
    rows = cells_k.any(1)
    pos = k.positions[rows].tolist()
    moved_sections = [s for s, a in enumerate(mapping) if a != s]
    text_keys = int((~image).sum())
    collapsed = all(a == 0 for a in mapping)
    if len(set(mapping[s] for s in moved_sections)) == 1:
        src = mapping[moved_sections[0]]
        sat = (
            f"sections {', '.join(MROPE_AXES[s] for s in moved_sections)} sit at their {MROPE_AXES[src]} position "
            f"({span_text(exp[rows, src].tolist())}) instead of their "
            + " and ".join(f"{MROPE_AXES[s]} ({span_text(exp[rows, s].tolist())})" for s in moved_sections)
            + f" (h {span_text(exp[rows, 1].tolist())}, w {span_text(exp[rows, 2].tolist())})"
        )
    else:
        sat = "sections " + ", ".join(
            f"{MROPE_AXES[s]} at their {MROPE_AXES[mapping[s]]} position" for s in moved_sections
        )
    text = (
        f"layer {km.layer}, query at {km.query_position}: image keys {span_text(pos)} ({len(pos)} keys): {sat}; "
        f"section t fits; the {text_keys} text keys fit all three streams"
        + (": M-RoPE axes collapsed to t" if collapsed else ": M-RoPE sections turned by the wrong streams")
    )
    return Match(
        KIND,
        share(km, cells),
        text,
        scope_of(km, cells, image[:, None].expand_as(cells_k)),
        {"section_streams": [MROPE_AXES[a] for a in mapping], "image_keys": len(pos)},
        rows_of(cells_k),
    )


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


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


FAULTS = (
    NativeFault(
        name="mrope-axes-collapsed",
        kind=KIND,
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
        kind=KIND,
        description="the cache's keys have their M-RoPE h/w streams overwritten by t (queries right)",
        key_form="rotated",
        shows_when="image-like positions (a case with an image grid)",
        rotation=MropeHwOverwrittenByT,
        needs=NEEDS,
        applies=_has_mrope,
        exposing=EXPOSING,
    ),
)
