"""Forensics of M-RoPE axes: where each key's temporal, height and width sections really sit.

Under M-RoPE (Qwen2-VL) a token's frequency pairs are cut into sections turned by three position
streams (t, h, w). For text the three are equal, so one fitted position per key says everything; for
an image-like token they differ, and a kernel that turned the token at one position (h and w
collapsed to t) is still a pure rotation, which the one-position forensics would read as a key at
position t. Here each key's effective position is fitted per stream, over that stream's pairs only:
the integer ``p`` maximizing ``Re sum_m c_m conj(r_m) exp(-i p w_m)`` (``r`` the reference's raw key,
``c`` the key as the kernel used it), then compared with the key's own streams.
"""

from __future__ import annotations

import torch

from ..rope import MROPE_AXES, PositionStreams, RopeSpec, pair_channels
from .bug_class import BugClass
from .diagnosis import Diagnosis


def fit_streams(rope: RopeSpec, k_raw: torch.Tensor, k_eff: torch.Tensor, candidates: int) -> torch.Tensor:
    """Each key's effective position per stream ``[3, N]`` from ``k_raw``, ``k_eff`` ``[N, KVH, D]``
    (integers ``0..candidates-1``; the KV heads fitted together)."""
    first, second = pair_channels(rope.rotary_dim, rope.layout)
    first, second = first + rope.rotary_offset, second + rope.rotary_offset
    r = torch.complex(k_raw[..., first].double(), k_raw[..., second].double())  # [N, KVH, n]
    c = torch.complex(k_eff[..., first].double(), k_eff[..., second].double())
    prod = (c * r.conj()).sum(1)  # [N, n]
    w = rope.inv_freq().double()  # [n]
    p = torch.arange(candidates, dtype=torch.float64)
    angle = p[:, None] * w[None, :]
    phase = torch.complex(torch.cos(angle), -torch.sin(angle))  # exp(-i p w) [P, n]
    axes = rope.section_axes()
    out = torch.empty(3, k_raw.shape[0], dtype=torch.int64)
    for a in range(3):
        sel = axes == a
        score = (prod[:, None, sel] * phase[None, :, sel]).real.sum(-1)  # [N, P]
        out[a] = score.argmax(-1)
    return out


def diagnose(
    rope: RopeSpec,
    streams: PositionStreams,
    *,
    k_raw: torch.Tensor,
    k_eff: torch.Tensor,
    key_positions: torch.Tensor,
    layer: int,
    query_position: int,
    where: dict[str, object],
) -> Diagnosis:
    """Name ``mrope_axes_collapsed`` when the image-like keys' h and w sections sit at their t
    position (and t where it belongs); otherwise ``unknown`` with the per-stream fit as evidence."""
    expected = streams.at(key_positions)  # [3, N]
    candidates = int(expected.max()) + int(key_positions.max()) + 8
    fitted = fit_streams(rope, k_raw, k_eff, candidates)
    image = (expected[1] != expected[0]) | (expected[2] != expected[0])  # keys whose streams differ
    right = (fitted == expected).all(0)
    at_t = (fitted == expected[0][None, :]).all(0)  # every section at the t position
    head = f"layer {layer}, query at {query_position}"
    details: dict[str, object] = {
        **where,
        "image_keys": int(image.sum()),
        "keys_right": int(right.sum()),
        "keys_read": int(key_positions.numel()),
    }
    img = torch.nonzero(image).flatten()
    if img.numel() and bool(at_t[img].all()) and bool(right[~image].all()):
        pos = key_positions[img]
        t, h, w = (expected[a, img] for a in range(3))
        details.update({"image_key_positions": [int(pos.min()), int(pos.max())]})
        return Diagnosis(
            BugClass.MROPE_AXES_COLLAPSED,
            f"{head}: image keys {int(pos.min())}..{int(pos.max())} ({img.numel()} keys): sections h, w sit at "
            f"their t position ({_span(t)}) instead of their grid row/column (h {_span(h)}, w {_span(w)}); "
            f"section t fits; the {int((~image).sum())} text keys fit all three streams: M-RoPE axes collapsed to t",
            details,
        )
    wrong = torch.nonzero(~right).flatten()
    if wrong.numel() == 0:
        return Diagnosis(
            BugClass.UNKNOWN,
            f"{head}: every key's t, h and w sections sit at its own streams; the divergence is not "
            "an M-RoPE axes error of the keys",
            details,
        )
    j = int(wrong[0])
    got = ", ".join(f"{MROPE_AXES[a]} {int(fitted[a, j])}" for a in range(3))
    want = ", ".join(f"{MROPE_AXES[a]} {int(expected[a, j])}" for a in range(3))
    return Diagnosis(
        BugClass.UNKNOWN,
        f"{head}: {wrong.numel()} of {key_positions.numel()} keys off their streams, not as h/w collapsed "
        f"to t (key {int(key_positions[j])}: {got}; its streams {want})",
        details,
    )


def _span(values: torch.Tensor) -> str:
    lo, hi = int(values.min()), int(values.max())
    return str(lo) if lo == hi else f"{lo}..{hi}"
