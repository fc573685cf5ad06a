"""layer_rope_mismatch: a layer turned under another layer's RoPE (local against global).

Models with per-layer RoPE (gemma3: theta 1e4 on sliding layers, 1e6 with scaling on full ones) give
each layer its spec; a kernel that takes the wrong one turns the layer's query (and keys) exactly,
under the other spec. The evidence names the spec used and the layer it belongs to.
"""

from __future__ import annotations

from ..faults.native import NativeFault
from ..faults.shapes import DecodeSideSpec
from ..parity.bug_class import BugClass
from ..parity.explain.evidence import CaseEvidence, Explanation, Match
from ..parity.explain.positions import rotation_match
from ..rope import RopeSpec

KIND = BugClass.LAYER_ROPE_MISMATCH


def explain(ev: CaseEvidence) -> Match | None:
    km = ev.keymap
    if km is None or km.rope is None:
        return None
    spec = km.rope
    kind = ev.facts.model.layer_attentions[km.layer].kind if ev.facts.model.layer_attentions else "full"

    def text(which: str, names: list[str], query: bool) -> str:
        who = " and ".join(x for x in ("its query" if query else "", which) if x)
        return (
            f"layer {km.layer} ({kind}) should turn with theta {spec.theta:g} ({spec.scaling.rope_type}), but "
            f"{who} are exact rotations under {names[0]}"
        )

    return rotation_match(ev, KIND, ("layer",), text, layer=km.layer)


EXPLANATION = Explanation(KIND, explain)


# ---------------------------------------------------------------------- faults of ropekv's engine (--inject)


def _kind_specs(ctx) -> tuple[RopeSpec | None, RopeSpec | None]:
    """(local, global): the spec of the first sliding layer and of the first full layer."""
    local = next((ctx.layer_ropes[i] for i in ctx.window_layers), None)
    global_ = next((r for i, r in enumerate(ctx.layer_ropes) if i not in ctx.window_layers), None)
    return local, global_


class LocalRopeOnGlobalLayers(DecodeSideSpec):
    """Global (full-attention) layers turn with the local (sliding) layers' RoPE (gemma3: theta 1e4
    instead of 1e6 and no scaling)."""

    name = "local-rope-on-global-layers"

    def spec(self, rope, ctx):
        return _kind_specs(ctx)[0] if ctx.layer not in ctx.window_layers and rope is not None else rope


class GlobalRopeOnLocalLayers(DecodeSideSpec):
    """Local (sliding) layers turn with the global layers' RoPE."""

    name = "global-rope-on-local-layers"

    def spec(self, rope, ctx):
        return _kind_specs(ctx)[1] if ctx.layer in ctx.window_layers and rope is not None else rope


def _has_two_kinds(cfg) -> bool:
    sliding = [i for i, a in enumerate(cfg.layer_attentions) if a.kind == "sliding"]
    full = [i for i, a in enumerate(cfg.layer_attentions) if a.kind != "sliding"]
    return (
        bool(sliding and full)
        and cfg.layer_rope(sliding[0]) not in (None, cfg.layer_rope(full[0]))
        and cfg.layer_rope(full[0]) is not None
    )


FAULTS = (
    NativeFault(
        name="local-rope-on-global-layers",
        kind=KIND,
        description="global layers turn with the local layers' RoPE",
        key_form="rotated",
        shows_when="any decode",
        rotation=LocalRopeOnGlobalLayers,
        needs="different RoPE on sliding and full layers (gemma3)",
        applies=_has_two_kinds,
    ),
    NativeFault(
        name="global-rope-on-local-layers",
        kind=KIND,
        description="local layers turn with the global layers' RoPE",
        key_form="rotated",
        shows_when="any decode",
        rotation=GlobalRopeOnLocalLayers,
        needs="different RoPE on sliding and full layers (gemma3)",
        applies=_has_two_kinds,
    ),
)
