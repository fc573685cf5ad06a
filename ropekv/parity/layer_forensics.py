"""Forensics of per-layer RoPE features: NoPE layers, partial rotary, per-layer-type RoPE.

:mod:`ropekv.parity.forensics` estimates effective positions under one RoPE spec. Architectures
with per-layer RoPE (gemma3's local and global layers, cohere2's and smollm3's NoPE layers) and partial
rotary (phi3, glm, stablelm, nemotron) have bug classes that spec alone cannot name: the query or keys
of the diverging layer are exact rotations, only under the wrong layer's spec, or rotated at all where
the layer has no position embedding, or turned on channels that must pass through. This module tests
those hypotheses directly, from the raw query/keys the reference recomputes and the ones the kernel
used, and returns a :class:`~ropekv.parity.diagnosis.Diagnosis` or None (then the general forensics run).

Multi-head latent attention (DeepSeek V2/V3) rotates only the trailing rope part of each key
(``rope.rotary_offset``); its own bug class is that part rotated twice (the shared ``k_pe`` turned once
in the latent and again after the per-head expansion, or turned on write and again on read): the
position-free channels are intact and the rope part sits at twice its position.

Kinds: ``nope_rotated``, ``partial_rotary_mismatch``, ``layer_rope_mismatch``, ``mla_rope_rotated_twice``.
"""

from __future__ import annotations

import torch

from ..models.config import ModelConfig
from ..rope import RopeSpec
from .bug_class import BugClass
from .diagnosis import Diagnosis

_MATCH = 1e-3  # scale-aware: float32 rotations agree to ~1e-6; a wrong spec is off by O(1)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.double(), b.double()
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max())) < _MATCH


def _rotated(spec: RopeSpec | None, x: torch.Tensor, positions: torch.Tensor, seq_len: int) -> torch.Tensor:
    return x.double() if spec is None else spec.rotate(x.double(), positions, seq_len)


def _ranges(mask: torch.Tensor) -> str:
    """``"0..7"`` / ``"8..15"`` / ``"0..3, 12..15"``: the channels set in ``mask``, as ranges."""
    idx, out, start = mask.nonzero().flatten().tolist(), [], None
    for i, c in enumerate(idx):
        if start is None:
            start = c
        if i + 1 == len(idx) or idx[i + 1] != c + 1:
            out.append(f"{start}..{c}")
            start = None
    return ", ".join(out)


def diagnose_layer(
    cfg: ModelConfig,
    layer: int,
    *,
    q_raw: torch.Tensor,
    q_eff: torch.Tensor,
    k_raw: torch.Tensor,
    k_eff: torch.Tensor,
    key_positions: torch.Tensor,
    query_position: int,
    seq_len: int,
) -> Diagnosis | None:
    """Name a per-layer RoPE bug on ``layer`` or return None.

    ``q_raw``/``q_eff`` ``[H, D]``: the query before RoPE (reference) and as the kernel used it;
    ``k_raw``/``k_eff`` ``[N, KVH, D]``: the keys at ``key_positions [N]``, likewise.
    """
    spec = cfg.layer_rope(layer)
    qpos = torch.tensor([query_position])
    q_raw, q_eff = q_raw[None], q_eff[None]  # [1, H, D]

    # Which of q and the keys the kernel used are exact rotations under a spec.
    def fits(candidate: RopeSpec | None) -> tuple[bool, bool]:
        return (
            _close(q_eff, _rotated(candidate, q_raw, qpos, seq_len)),
            _close(k_eff, _rotated(candidate, k_raw, key_positions, seq_len)),
        )

    if all(fits(spec)):
        return None
    others = []
    for i in range(cfg.num_layers):
        candidate = cfg.layer_rope(i)
        if candidate != spec and candidate not in others:
            others.append(candidate)
    if spec is None:
        for candidate in others:
            if candidate is None:  # others differ from spec: never None here
                continue
            q_fit, k_fit = fits(candidate)
            if q_fit or k_fit:
                what = " and ".join(n for n, f in (("query", q_fit), ("keys", k_fit)) if f)
                return Diagnosis(
                    BugClass.NOPE_ROTATED,
                    (
                        f"layer {layer} has no position embedding (NoPE), but its {what} are rotations under the RoPE "
                        f"of the other layers (theta {candidate.theta:g}, rotary_dim {candidate.rotary_dim})"
                    ),
                    {"layer": layer, "theta": candidate.theta},
                )
        return Diagnosis(
            BugClass.NOPE_ROTATED,
            f"layer {layer} has no position embedding (NoPE), but the kernel's query "
            "or keys differ from the raw ones: they were turned",
            {"layer": layer},
        )
    if spec.rotary_dim < spec.head_dim:
        rotated = torch.zeros(spec.head_dim, dtype=torch.bool)
        rotated[spec.rotary_offset : spec.rotary_offset + spec.rotary_dim] = True
        keep = ~rotated  # the channels that pass through
        if not _close(q_eff[..., keep], q_raw[..., keep]) or not _close(k_eff[..., keep], k_raw[..., keep]):
            full = (
                spec.replace(rotary_dim=spec.head_dim, rotary_offset=0) if spec.scaling.short_factor is None else None
            )
            how = ""
            if full is not None and any(fits(full)):
                how = f": they fit a rotation of all {spec.head_dim} channels at the whole head's frequencies"
            return Diagnosis(
                BugClass.PARTIAL_ROTARY_MISMATCH,
                (
                    f"layer {layer} rotates only {spec.rotary_dim} of {spec.head_dim} channels, but the kernel's "
                    f"pass-through channels {_ranges(keep)} changed (partial rotary applied to "
                    f"every channel){how}"
                ),
                {"layer": layer, "rotary_dim": spec.rotary_dim},
            )
    if cfg.mla is not None:
        q_fit, k_fit = fits(spec)
        q_twice = _close(q_eff, _rotated(spec, _rotated(spec, q_raw, qpos, seq_len), qpos, seq_len))
        k_twice = _close(k_eff, _rotated(spec, _rotated(spec, k_raw, key_positions, seq_len), key_positions, seq_len))
        if (q_twice or k_twice) and (q_fit or q_twice) and (k_fit or k_twice):
            what = " and ".join(n for n, f in (("query", q_twice and not q_fit), ("keys", k_twice and not k_fit)) if f)
            return Diagnosis(
                BugClass.MLA_ROPE_ROTATED_TWICE,
                (
                    f"layer {layer} is multi-head latent attention: its position-free channels 0.."
                    f"{spec.rotary_offset - 1} are intact, but the rope part (channels {spec.rotary_offset}.."
                    f"{spec.rotary_offset + spec.rotary_dim - 1}) of the {what} was rotated twice: it sits at twice "
                    "its position (the shared k_pe turned in the latent and again after expansion, or on write and "
                    "again on read)"
                ),
                {"layer": layer, "rope_channels": [spec.rotary_offset, spec.rotary_offset + spec.rotary_dim]},
            )
    for candidate in others:
        if candidate is None:
            continue
        q_fit, k_fit = fits(candidate)
        if q_fit:
            source = next(i for i in range(cfg.num_layers) if cfg.layer_rope(i) == candidate)
            kind = cfg.layer_types[layer].replace("_attention", "")
            return Diagnosis(
                BugClass.LAYER_ROPE_MISMATCH,
                (
                    f"layer {layer} ({kind}) should turn with theta {spec.theta:g} ({spec.scaling.rope_type}), but its "
                    f"query{' and keys' if k_fit else ''} are exact rotations under layer {source}'s RoPE "
                    f"({cfg.layer_types[source].replace('_attention', '')}: theta {candidate.theta:g}, "
                    f"{candidate.scaling.rope_type})"
                ),
                {"layer": layer, "used_layer": source, "theta": candidate.theta},
            )
    return None
