"""The fault catalogue of ropekv's engine: small, named variants of the engine, one per bug class (docs/report.md).

Each fault overrides one decision of :class:`~ropekv.engine.rotation.RotationPolicy` (or, for stale dynamic
scaling, lets the engine accept a contract it would refuse; for chunked attention, runs the engine
under a contract that forgets the chunks). ``ropekv check --inject NAME`` runs the
harness on the faulty engine; the tests assert that each is caught and named with its own kind.
:data:`CATALOGUE` holds them (:mod:`ropekv.faults.registry` reads it): first those every model can
run, then those of per-layer RoPE features, each needing a model that has the feature (``needs``).
"""

from __future__ import annotations

import torch

from ..contract import CacheContract
from ..engine.rotation import RotationPolicy, rotate
from ..models.config import Checkpoint
from ..parity.cases import Case
from ..rope import RopeScaling, RopeSpec, apply_rotation
from .decode_side import DecodeSideSpec
from .native import NativeFault


class DoubleRotation(RotationPolicy):
    """Decode reads rotated keys and rotates them again (key at 2j)."""

    name = "double-rotation"

    def read_keys(self, rope, stored, rotation_index, slots, ctx, *, backend_rotates):
        if ctx.phase == "decode" and rope is not None:  # NoPE layers have nothing to rotate twice
            return rope.rotate(stored.float(), rotation_index, ctx.seq_len)
        return super().read_keys(rope, stored, rotation_index, slots, ctx, backend_rotates=backend_rotates)


class MissingRotation(RotationPolicy):
    """The writer stores raw keys in a cache whose reader assumes rotated ones (key at 0)."""

    name = "missing-rotation"

    def write_key(self, rope, k, positions, slots, ctx):
        return k if ctx.cached else super().write_key(rope, k, positions, slots, ctx)


class SlotAsPosition(RotationPolicy):
    """Rotate-on-read takes the ring slot as the rotation index (key at its slot once the window wraps)."""

    name = "slot-as-position"

    def read_keys(self, rope, stored, rotation_index, slots, ctx, *, backend_rotates):
        index = slots if ctx.cached else rotation_index
        return super().read_keys(rope, stored, index, slots, ctx, backend_rotates=backend_rotates)


class IgnoredPrefixOffset(RotationPolicy):
    """After a prefix-cache hit the new tokens are rotated from 0 instead of from P (key at j - P)."""

    name = "ignored-prefix-offset"

    def query(self, rope, q, positions, ctx):
        return super().query(rope, q, positions - ctx.fork_offset if ctx.cached else positions, ctx)

    def write_key(self, rope, k, positions, slots, ctx):
        shifted = positions - ctx.fork_offset if ctx.cached else positions
        return super().write_key(rope, k, shifted, slots, ctx)


class BlockLocalPosition(RotationPolicy):
    """Keys are rotated by their offset inside their cache block (key at j mod B)."""

    name = "block-local-position"

    def write_key(self, rope, k, positions, slots, ctx):
        local = positions % ctx.block_size if ctx.cached else positions
        return super().write_key(rope, k, local, slots, ctx)


class DecodePositionOffByOne(RotationPolicy):
    """The decode step rotates its query one position too far (query at t + 1)."""

    name = "decode-position-off-by-one"

    def query(self, rope, q, positions, ctx):
        return super().query(rope, q, positions + 1 if ctx.phase == "decode" else positions, ctx)


class _DecodeSideSpec(RotationPolicy):
    """The decode side turns queries and new keys with another spec than prefill did."""

    def other(self, rope: RopeSpec) -> RopeSpec:
        raise NotImplementedError

    def query(self, rope, q, positions, ctx):
        return super().query(self.other(rope) if ctx.phase == "decode" and rope else rope, q, positions, ctx)

    def write_key(self, rope, k, positions, slots, ctx):
        spec = self.other(rope) if ctx.phase == "decode" and rope else rope
        return super().write_key(spec, k, positions, slots, ctx)

    def read_keys(self, rope, stored, rotation_index, slots, ctx, *, backend_rotates):
        spec = self.other(rope) if ctx.phase == "decode" and rope else rope
        return super().read_keys(spec, stored, rotation_index, slots, ctx, backend_rotates=backend_rotates)


class ScalingMismatch(_DecodeSideSpec):
    """The decode side uses theta x 4 (a config read with another base or scaling)."""

    name = "scaling-mismatch"

    def other(self, rope):
        return rope.replace(theta=rope.theta * 4)


class LayoutMismatch(_DecodeSideSpec):
    """The decode side pairs channels the other way (neox vs gptj)."""

    name = "layout-mismatch"

    def other(self, rope):
        return rope.replace(layout="gptj" if rope.layout == "neox" else "neox")


def _bf16_rotate(rope: RopeSpec | None, x: torch.Tensor, positions: torch.Tensor, seq_len: int) -> torch.Tensor:
    if rope is None:  # a NoPE layer
        return x
    ang = (positions.to(torch.bfloat16)[:, None] * rope.inv_freq(seq_len).to(torch.bfloat16)[None, :]).double()
    return apply_rotation(
        x,
        torch.cos(ang) * rope.attention_factor,
        torch.sin(ang) * rope.attention_factor,
        rope.layout,
        rope.rotary_offset,
    )


class LowPrecisionAngles(RotationPolicy):
    """Angles computed in bfloat16 everywhere (both engine paths agree; only float64 catches it)."""

    name = "low-precision-angles"

    def query(self, rope, q, positions, ctx):
        return _bf16_rotate(rope, q, positions, ctx.seq_len)

    def write_key(self, rope, k, positions, slots, ctx):
        return _bf16_rotate(rope, k, positions, ctx.seq_len)

    def read_keys(self, rope, stored, rotation_index, slots, ctx, *, backend_rotates):
        if backend_rotates:
            return _bf16_rotate(rope, stored.float(), rotation_index, ctx.seq_len)
        return stored


class StaleDynamicRotation(RotationPolicy):
    """Keeps rotated keys under dynamic NTK instead of refusing the contract (stale frequencies)."""

    name = "stale-dynamic-scaling"

    def check_contract(self, contract) -> None:
        return None


def dynamic_variant(ckpt: Checkpoint, original_max: int = 64, factor: float = 2.0) -> Checkpoint:
    """The same weights with dynamic NTK RoPE whose original length is ``original_max`` (attention factor
    1, as transformers' dynamic NTK has, whatever scaling the model had)."""
    rope = ckpt.config.rope.replace(
        scaling=RopeScaling("dynamic", factor=factor), max_position_embeddings=original_max, attention_factor=1.0
    )
    return ckpt.with_config(ckpt.config.replace(rope=rope))


# ---------------------------------------------------------------------- architecture faults
# Faults of per-layer RoPE features (ropekv.models.families); each needs a model that has the feature
# (``NativeFault.needs``), so the registry lists them apart from those every model can run.


class PartialRotaryAllChannels(DecodeSideSpec):
    """Partial rotary applied to every channel: the pass-through channels turn too, at frequencies
    computed for the whole head."""

    name = "partial-rotary-all-channels"

    def spec(self, rope, ctx):
        if rope is None or rope.rotary_dim == rope.head_dim:
            return rope
        return rope.replace(rotary_dim=rope.head_dim, rotary_offset=0)  # MLA: the position-free part turns too


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


class NopeLayerRotated(DecodeSideSpec):
    """A layer without position embedding (NoPE) turns its queries and keys with the model's RoPE."""

    name = "nope-layer-rotated"

    def spec(self, rope, ctx):
        return next((r for r in ctx.layer_ropes if r is not None), None) if rope is None else rope


class MlaRopeRotatedTwice(RotationPolicy):
    """Multi-head latent attention: the shared rope part ``k_pe`` is rotated when the latent row is
    written and again after the per-head expansion, so the cached keys' rope part sits at ``2j`` (their
    position-free part is untouched; the query is right)."""

    name = "mla-rope-rotated-twice"

    def write_key(self, rope, k, positions, slots, ctx):
        once = super().write_key(rope, k, positions, slots, ctx)
        return rotate(rope, once, positions, ctx) if ctx.cached and rope is not None else once


def _has_mla(cfg) -> bool:
    return cfg.mla is not None


def _has_partial(cfg) -> bool:
    return any(r is not None and r.rotary_dim < r.head_dim for r in (cfg.layer_rope(i) for i in range(cfg.num_layers)))


def _has_two_kinds(cfg) -> bool:
    sliding = [i for i, a in enumerate(cfg.layer_attentions) if a.kind == "sliding"]
    full = [i for i, a in enumerate(cfg.layer_attentions) if a.kind != "sliding"]
    return (
        bool(sliding and full)
        and cfg.layer_rope(sliding[0]) not in (None, cfg.layer_rope(full[0]))
        and cfg.layer_rope(full[0]) is not None
    )


def _has_nope(cfg) -> bool:
    return any(cfg.layer_rope(i) is None for i in range(cfg.num_layers))


def _has_chunks(cfg) -> bool:
    return any(a.kind == "chunked" for a in cfg.layer_attentions)


def _forget_chunks(contract: CacheContract) -> CacheContract:
    """Chunked layers read as full ones: every cached key, earlier chunks included, reaches the kernel."""
    return contract.replace(chunk_size=None, chunk_layers=())


def _has_window_and_full(cfg) -> bool:
    kinds = {a.kind for a in cfg.layer_attentions}
    return "sliding" in kinds and "full" in kinds


def _window_every_layer(contract: CacheContract) -> CacheContract:
    """The global layers slide too: every layer reads only the last ``window`` keys."""
    return contract.replace(window_layers=tuple(range(contract.num_layers)))


def _forget_windows(contract: CacheContract) -> CacheContract:
    """The sliding layers read as full ones: every cached key reaches the kernel (a window ignored)."""
    return contract.replace(window=None, window_layers=(), sink_tokens=0)


CATALOGUE: tuple[NativeFault, ...] = (
    NativeFault(
        name="double-rotation",
        kind="double_rotation",
        description="decode rotates already-rotated keys again",
        key_form="rotated",
        shows_when="any decode past position 0",
        rotation=DoubleRotation,
    ),
    NativeFault(
        name="missing-rotation",
        kind="missing_rotation",
        description="raw keys stored where rotated ones are expected",
        key_form="rotated",
        shows_when="any decode past position 0",
        rotation=MissingRotation,
    ),
    NativeFault(
        name="slot-as-position",
        kind="slot_as_position",
        description="ring slot used as rotation index",
        key_form="raw",
        shows_when="a sliding window that has wrapped",
        rotation=SlotAsPosition,
    ),
    NativeFault(
        name="ignored-prefix-offset",
        kind="ignored_prefix_offset",
        description="positions restart at 0 after a prefix-cache hit",
        key_form="rotated",
        shows_when="a nonzero prefix offset",
        rotation=IgnoredPrefixOffset,
    ),
    NativeFault(
        name="block-local-position",
        kind="block_local_position",
        description="keys rotated by their offset inside the block",
        key_form="rotated",
        shows_when="a context longer than one block",
        rotation=BlockLocalPosition,
    ),
    NativeFault(
        name="decode-position-off-by-one",
        kind="query_position_offset",
        description="decode query rotated at t + 1",
        key_form="rotated",
        shows_when="any decode",
        rotation=DecodePositionOffByOne,
    ),
    NativeFault(
        name="scaling-mismatch",
        kind="frequency_mismatch",
        description="decode side uses theta x 4",
        key_form="rotated",
        shows_when="any decode",
        rotation=ScalingMismatch,
    ),
    NativeFault(
        name="layout-mismatch",
        kind="layout_mismatch",
        description="decode side pairs channels the other way",
        key_form="rotated",
        shows_when="any decode",
        rotation=LayoutMismatch,
    ),
    NativeFault(
        name="low-precision-angles",
        kind="low_precision_angles",
        description="rotation angles computed in bfloat16 in every path",
        key_form="rotated",
        shows_when="positions past a few hundred; only the float64 reference sees it",
        rotation=LowPrecisionAngles,
    ),
    NativeFault(
        name="stale-dynamic-scaling",
        kind="stale_dynamic_scaling",
        description="rotated keys under dynamic NTK (original length 64, factor 2 unless the model has its own)",
        key_form="rotated",
        shows_when="decoding past the original length",
        rotation=StaleDynamicRotation,
        # dynamic NTK even on a LongRoPE model: rotated LongRoPE keys across its switch hold two rotations,
        # which is mixed_rotations (ropekv.faults.mixed_rotations), not this class
        model=lambda c: c if c.config.rope.scaling.rope_type == "dynamic" else dynamic_variant(c),
        fixed_key_form=True,
        # a prompt inside the original length decoded past it: the cached keys keep the frequencies of
        # length 64 while the queries move on (a prefill past it turns every chunk under the prefill's
        # own length, so only the decode steps after it drift, too little for the final logits)
        exposing=(Case(length=60, decode_steps=8, block_size=7),),
    ),
    NativeFault(
        name="partial-rotary-all-channels",
        kind="partial_rotary_mismatch",
        description="partial rotary applied to every channel of the head",
        key_form="rotated",
        shows_when="any decode",
        rotation=PartialRotaryAllChannels,
        needs="partial rotary (phi3, glm, stablelm, nemotron, gpt_neox)",
        applies=_has_partial,
    ),
    NativeFault(
        name="local-rope-on-global-layers",
        kind="layer_rope_mismatch",
        description="global layers turn with the local layers' RoPE",
        key_form="rotated",
        shows_when="any decode",
        rotation=LocalRopeOnGlobalLayers,
        needs="different RoPE on sliding and full layers (gemma3)",
        applies=_has_two_kinds,
    ),
    NativeFault(
        name="global-rope-on-local-layers",
        kind="layer_rope_mismatch",
        description="local layers turn with the global layers' RoPE",
        key_form="rotated",
        shows_when="any decode",
        rotation=GlobalRopeOnLocalLayers,
        needs="different RoPE on sliding and full layers (gemma3)",
        applies=_has_two_kinds,
    ),
    NativeFault(
        name="nope-layer-rotated",
        kind="nope_rotated",
        description="a NoPE layer turns its queries and keys",
        key_form="rotated",
        shows_when="any decode past position 0",
        rotation=NopeLayerRotated,
        needs="NoPE layers (cohere2, smollm3, exaone4)",
        applies=_has_nope,
    ),
    NativeFault(
        name="mla-rope-rotated-twice",
        kind="mla_rope_rotated_twice",
        description="MLA's shared rope part rotated in the latent and again after expansion",
        key_form="rotated",
        shows_when="any decode past position 0",
        rotation=MlaRopeRotatedTwice,
        needs="multi-head latent attention (deepseek_v2, deepseek_v3)",
        applies=_has_mla,
        fixed_key_form=True,
    ),
    NativeFault(
        name="window-on-global-layers",
        kind="window_mismatch",
        description="the global (full-attention) layers slide over the window too",
        key_form="rotated",
        shows_when="a context longer than the window",
        rotation=RotationPolicy,
        needs="sliding and full layers (gemma3)",
        applies=_has_window_and_full,
        contract_change=_window_every_layer,
    ),
    NativeFault(
        name="sliding-layers-unwindowed",
        kind="window_mismatch",
        description="the sliding layers read every cached key (their window ignored)",
        key_form="rotated",
        shows_when="a context longer than the window",
        rotation=RotationPolicy,
        needs="sliding layers of the model's own (gemma3, mistral)",
        applies=lambda cfg: any(a.kind == "sliding" for a in cfg.layer_attentions),
        contract_change=_forget_windows,
    ),
    NativeFault(
        name="chunked-layers-read-earlier-chunks",
        kind="chunk_mismatch",
        description="chunked layers attend to the keys of earlier chunks (read as full attention)",
        key_form="rotated",
        shows_when="a query past the first chunk boundary",
        rotation=RotationPolicy,
        needs="chunked attention (llama4)",
        applies=_has_chunks,
        contract_change=_forget_chunks,
    ),
)
