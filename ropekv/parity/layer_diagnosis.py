"""The diagnosis at a case's first divergent layer, assembled from the forensics.

The harness (:mod:`ropekv.parity.harness`) locates the first divergence and hands over what the
engine's kernel used there and what the float64 reference computed; this module names the bug, in
order (first match wins):

1. a mask: the kernel read keys the reference's window (or chunk) hides, or missed visible ones ->
   ``window_mismatch`` / ``chunk_mismatch`` (not a rotation at all);
   then, after a handoff, handed-off keys found at other rows and heads as one block layout read as the
   other predicts -> ``block_layout_mismatch`` (:mod:`ropekv.parity.transfer_layout`);
2. per-layer RoPE features (:func:`ropekv.parity.layer_forensics.diagnose_layer`: NoPE layers,
   partial rotary, local/global RoPE, latent attention), which one spec alone cannot name;
3. a layer without position embedding whose query and keys are not turned -> ``unknown``;
4. under LongRoPE, keys of one range of rows under its short factors and of another under its long
   factors -> ``mixed_rotations`` (:func:`ropekv.parity.mixed_rotations.diagnose_mixed`);
5. the general forensics (:func:`ropekv.parity.forensics.diagnose`) under the layer's own spec (for
   latent attention, its rope slice); a clean ``unknown`` on a deeper layer of length-dependent RoPE
   becomes ``stale_dynamic_scaling`` (its cached prefix was computed under an earlier length).

Every diagnosis's details carry the case, the layer and the query position.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..errors import UsageError
from ..models.config import ModelConfig
from ..probe import LayerProbe
from . import forensics, mrope_forensics, ops
from .bug_class import BugClass
from .cases import Case
from .diagnosis import Diagnosis
from .layer_forensics import diagnose_layer
from .mixed_rotations import diagnose_mixed
from .report import Divergence
from .transfer_layout import diagnose_block_layout


def diagnose_unlocated(fd: Divergence | None) -> Diagnosis:
    """A failing case whose divergence names no layer (``fd`` None, or at the logits only)."""
    if fd is None:
        return Diagnosis(BugClass.UNKNOWN, "the final logits diverged but no layer's attention did")
    return Diagnosis(BugClass.UNKNOWN, "only the final logits diverged; no layer's attention did")


def diagnose_divergence(
    cfg: ModelConfig,
    case: Case,
    fd: Divergence,
    *,
    view: LayerProbe,
    reference: LayerProbe,
    row: int,
    reference_attn: torch.Tensor,
    handoff_len: int,
    self_parity_passed: bool,
    key_form: str | None,
) -> Diagnosis:
    """Name the bug at ``fd``'s layer (``fd.layer`` not None).

    ``view``: the engine's probe of that layer at the diverging decode step (``q [1, H, D]``,
    ``k [N, KVH, D]`` at ``key_positions [N]``, ``key_slots [N]`` or None); ``reference``: the float64
    reference's probe of the layer (``q_raw [R, H, D]`` with the decode row at index ``row``,
    ``k_raw [T, KVH, D]`` by token index); ``reference_attn [H, T]``: the reference's attention logits of
    the decode row by position (-inf where its mask hides a key). ``handoff_len``: tokens that crossed
    a handoff; ``key_form``: the engine's (shapes the cache-operation hypotheses).
    """
    layer = fd.layer
    if layer is None:
        raise UsageError("diagnose_divergence needs a divergence at a layer; see diagnose_unlocated")
    where = {"case": case.label(), "layer": layer, "query_position": fd.query_position}
    chunk = cfg.layer_chunk(layer) if case.window is None else None  # a case window replaces chunks
    # The hypotheses the case can show come first: an eviction's labels (a compacting cache numbers its
    # keys by kept row), then a mask, and a window or chunk mask only where this layer has one.
    view, relabelled = _compacted_labels(view, reference_attn, case)
    masked = case.window is not None or cfg.layer_window(layer) is not None or chunk is not None
    window = None if relabelled else _window_diagnosis(reference_attn, view, case, fd, layer, chunk)
    if window is not None and (masked or _window_shaped(view.key_positions, reference_attn)):
        return window
    if window is not None:
        return Diagnosis(
            BugClass.UNKNOWN,
            f"{window.evidence}; layer {layer} has no window or chunk, so this is no window bug: the kernel "
            "read other keys than the ones a full-attention layer sees (a cache that lost or relabelled rows)",
            window.details,
        )
    if reference.q_raw is None or reference.k_raw is None:
        raise UsageError("the reference's probe carries no raw query and keys")
    slots = view.key_slots if view.key_slots is not None else torch.full_like(view.key_positions, -1)
    k_raw = reference.k_raw[
        view.key_positions - case.shift
    ]  # the reference's rows are indices (a shift moves positions)
    q_raw, q_eff, k_eff = reference.q_raw[row], view.q[0], view.k
    # A transfer's block bytes read in another order: handed-off keys at other rows and heads, not a rotation.
    moved = diagnose_block_layout(
        cfg.layer_rope(layer),
        reference.k_raw,
        k_eff,
        view.key_positions,
        handoff_len=handoff_len,
        block_size=case.block_size,
        window=case.window if case.window is not None else cfg.layer_attentions[layer].window,
        sinks=case.sink_tokens,
        shift=case.shift,
    )
    if moved is not None:
        return Diagnosis(moved.kind, moved.evidence, {**moved.details, **where})
    streams, layer_rope = case.position_streams(), cfg.layer_rope(layer)
    if streams is not None and layer_rope is not None and layer_rope.mrope_section is not None:
        return mrope_forensics.diagnose(
            layer_rope,
            streams,
            k_raw=k_raw,
            k_eff=k_eff,
            key_positions=view.key_positions,
            layer=layer,
            query_position=fd.query_position,
            where=where,
        )
    # Per-layer RoPE features first (NoPE layers, partial rotary, local/global RoPE): bug classes one
    # spec alone cannot name. Then the general forensics under the diverging layer's own spec.
    arch = diagnose_layer(
        cfg,
        layer,
        q_raw=q_raw,
        q_eff=q_eff,
        k_raw=k_raw,
        k_eff=k_eff,
        key_positions=view.key_positions,
        query_position=fd.query_position,
        seq_len=fd.query_position + 1,
    )
    if arch is not None:
        return Diagnosis(arch.kind, arch.evidence, {**arch.details, **where})
    rope = cfg.layer_rope(layer)
    if rope is None:
        return Diagnosis(
            BugClass.UNKNOWN,
            f"layer {layer} has no position embedding and its query and keys are not "
            "turned; the divergence is not a RoPE error of this layer",
            where,
        )
    if rope.rotary_offset:  # MLA: only the rope part turns; the forensics read that slice as a head of its own
        part = slice(rope.rotary_offset, rope.rotary_offset + rope.rotary_dim)
        q_raw, q_eff, k_raw, k_eff = q_raw[..., part], q_eff[..., part], k_raw[..., part], k_eff[..., part]
        rope = rope.replace(head_dim=rope.rotary_dim, rotary_offset=0)
    inp = forensics.ForensicInput(
        rope=rope,
        q_raw=q_raw,
        q_eff=q_eff,
        k_raw=k_raw,
        k_eff=k_eff,
        query_position=fd.query_position,
        key_positions=view.key_positions,
        key_slots=slots,
        fork_offset=case.prefix,
        # Even where the adapter ignores block sizes, the case's block size is the hypothesis to test:
        # an engine with its own blocks may still rotate keys by their offset inside one.
        block_size=case.block_size,
        handoff_len=handoff_len,
        self_parity_passed=self_parity_passed,
        seq_len=fd.query_position + 1,
        op_hypotheses=ops.hypotheses(case, key_form, fd.step),
    )
    # A LongRoPE cache holding rows under both factor sets comes first: the general forensics would read
    # its short rows as keys of an earlier length (stale_dynamic_scaling) without naming the ranges.
    d = diagnose_mixed(inp) or forensics.diagnose(inp)
    kind, evidence = d.kind, d.evidence
    if relabelled:
        renumbered = _kept_row_rotation(d, view.key_positions, case, fd.query_position)
        if renumbered is not None:
            kind, evidence = BugClass.EVICT_OFFSET, renumbered
        evidence = f"{relabelled}; {evidence}"
    if kind == BugClass.UNKNOWN and inp.rope.length_dependent and layer > 0:
        # Layer 0 matched and this layer's rotations are right: what differs is the cached prefix itself,
        # whose deeper keys and values were computed under an earlier length's frequencies. A full
        # forward over t + 1 tokens recomputes them; no cache can (docs/contract.md).
        kind = BugClass.STALE_DYNAMIC_SCALING
        evidence = (
            f"layer 0 matches and layer {layer} turns keys at the current frequencies, but its cached "
            f"keys and values come from hidden states computed under an earlier length's frequencies "
            f"(inherent to caching {inp.rope.scaling.rope_type} RoPE past position "
            f"{inp.rope.switch_length}); {evidence}"
        )
    details = dict(d.details)
    details.update({**where, "query_effective": d.query_effective, "fit": _finite(d.fit)})
    return Diagnosis(
        kind, evidence, details, query_effective=d.query_effective, key_effective=d.key_effective, fit=d.fit
    )


def _compacted_labels(view: LayerProbe, ref_row: torch.Tensor, case: Case) -> tuple[LayerProbe, str]:
    """After an eviction, keys labelled by their kept-row index (a cache compacted and renumbered
    0..n-1) instead of their positions: the engine read as many keys as the reference shows, the
    labels of the kept rows are 0..n-1 and the evicted positions are among them. The keys then are, in
    order, the reference's visible positions; returns the probe relabelled with them and a sentence
    saying so (``view`` and "" where the labels are positions). ``ref_row [H, T]`` by position."""
    if case.op is None or case.op.kind != "evict":
        return view, ""
    visible = torch.nonzero(torch.isfinite(ref_row[0])).flatten()  # [V] positions, ascending
    labels = view.key_positions
    order = labels.argsort()
    if labels.numel() != visible.numel() or torch.equal(labels[order], visible):
        return view, ""
    end = case.prefix + case.length  # tokens cached before the eviction
    kept = labels[order][visible[: labels.numel()] < end]
    if not torch.equal(kept, torch.arange(kept.numel(), dtype=kept.dtype)):
        return view, ""
    true = torch.empty_like(labels)
    true[order] = visible
    moved = int((true != labels).sum())
    text = (
        f"the cache labels its {kept.numel()} keys kept by the eviction 0..{kept.numel() - 1} (compacted: numbered "
        f"by kept row, {moved} of them not their positions; the evicted positions {case.evicted_positions} "
        "were renumbered away); read at their true positions"
    )
    return dataclasses.replace(view, key_positions=true), text


def _window_shaped(pos: torch.Tensor, ref_row: torch.Tensor) -> bool:
    """On a layer with no window of its own: whether the kernel read a window anyway (the newest keys
    and perhaps a few first ones, every key it missed between them and none the reference hides), as an
    engine sliding its full layers does; relabelled or lost rows read otherwise. ``pos [N]`` the keys
    read, ``ref_row [H, T]`` the reference's row by position."""
    visible = torch.isfinite(ref_row[0])
    if bool((~visible[pos]).any()):
        return False
    read = torch.zeros_like(visible)
    read[pos] = True
    missed = torch.nonzero(visible & ~read).flatten()
    if missed.numel() == 0:
        return False
    inside = (pos > missed.min()) & (pos < missed.max())
    return not bool(inside.any()) and bool((pos > missed.max()).any())


def _kept_row_rotation(d: Diagnosis, positions: torch.Tensor, case: Case, t: int) -> str | None:
    """Whether the forensics' effective positions are the kept-row numbers: every key at ``j`` minus the
    evicted tokens before it, the query at ``t`` minus all of them (a compacting cache turning raw keys
    at their renumbered rows and continuing from the kept count); the sentence saying so, else None."""
    gone = torch.tensor(sorted(case.evicted_positions), dtype=torch.int64)
    want = positions - torch.searchsorted(gone, positions)  # [N]
    got = [(e, int(w)) for e, w in zip(d.key_effective, want.tolist(), strict=True) if e is not None]
    if d.query_effective != t - gone.numel() or not got:
        return None
    if sum(e == w for e, w in got) < forensics.MOST * len(got):
        return None
    return (
        f"every key sits at its kept-row number (j minus the evicted tokens before it) and the query at "
        f"{t} - {gone.numel()} = {d.query_effective}: the offset counts kept rows, so positions lost the "
        f"{gone.numel()} evicted tokens ({sum(e == w for e, w in got)} of {len(got)} fitting keys)"
    )


def _window_diagnosis(
    ref_row: torch.Tensor, view: LayerProbe, case: Case, fd: Divergence, layer: int, chunk: int | None
) -> Diagnosis | None:
    """The kernel read keys the reference's window hides, or missed keys it shows: a mask or window
    bug (a cache that ignores its size, sinks kept where none are configured), not a rotation. On a
    chunked layer (``chunk``) the same evidence is ``chunk_mismatch``: keys of an earlier chunk read
    (an engine that treats llama4's chunked layers as full), or keys of the query's chunk missed.
    ``ref_row [H, T]`` by position."""
    visible = torch.isfinite(ref_row[0])  # [T] by position
    pos = view.key_positions  # [N]
    extra = pos[~visible[pos]]
    read = torch.zeros_like(visible)
    read[pos] = True
    missed = torch.nonzero(visible & ~read).flatten()
    if extra.numel() == 0 and missed.numel() == 0:
        return None
    parts = []
    hides = (
        "the window hides"
        if chunk is None
        else (
            f"of earlier chunks (chunk size {chunk}: the query's chunk starts at {fd.query_position // chunk * chunk})"
        )
    )
    if extra.numel():
        parts.append(f"it read {extra.numel()} key(s) {hides} (positions {_span(extra)})")
    if missed.numel():
        parts.append(f"it missed {missed.numel()} visible key(s) (positions {_span(missed)})")
    details: dict[str, object] = {
        "case": case.label(),
        "layer": layer,
        "query_position": fd.query_position,
        "extra_keys": int(extra.numel()),
        "missed_keys": int(missed.numel()),
        "keys_read": int(pos.numel()),
    }
    if chunk is not None:
        details["chunk_size"] = chunk
    return Diagnosis(
        BugClass.WINDOW_MISMATCH if chunk is None else BugClass.CHUNK_MISMATCH,
        f"layer {layer}, query at {fd.query_position}: the reference attends to "
        f"{int(visible.sum())} keys, the kernel to {pos.numel()}; " + "; ".join(parts),
        details,
    )


def _span(positions: torch.Tensor) -> str:
    p = sorted(positions.tolist())
    return ", ".join(map(str, p)) if len(p) <= 6 else f"{p[0]}..{p[-1]}"


def _finite(x: float | None) -> float | None:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None
