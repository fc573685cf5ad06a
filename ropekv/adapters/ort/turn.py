"""The rotation ONNX Runtime's kernel gave a token, measured from the token's own key.

``GroupQueryAttention`` turns a token's query and its new key with the same angles (one position id,
one row of the cos/sin caches, one pairing) and writes only the key out (into the KV buffer). The
query it multiplied is therefore the pre-RoPE query turned by the factor that took the token's raw key
to its stored key: per channel pair, ``c = sum_h k_rot[h] * conj(k_raw[h]) / sum_h |k_raw[h]|^2`` over the
KV heads, in the pairing the node's ``rotary_interleaved`` attribute names. Nothing of ropekv's RoPE
goes into it: a kernel turning by the wrong angle, frequency, magnitude or pairing gives a query turned
the same wrong way, which the forensics then see. The engine checks the query against the kernel's own
scores (``qk_output``) wherever the kernel returns them (:func:`check_scores`). A pair that is zero in
the token's key (every KV head) shows no turn; it takes the node's own cos/sin table at the position the
Generator fed (:func:`table_turn`). Such a pair is zero in every key, so it adds nothing to any score.
"""

from __future__ import annotations

import torch

from ...errors import AdapterError

SCORE_TOLERANCE = 1e-3  # scale-aware: float32 dot products of 64-256 channels agree to ~1e-5


def pairs(head_dim: int, rotary_dim: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The channel indices ``(a, b)`` of each rotated pair: ``(2m, 2m+1)`` interleaved, ``(m, m + rd/2)``
    half-split (NeoX); channels past ``rotary_dim`` are not turned."""
    half = rotary_dim // 2
    m = torch.arange(half)
    if interleaved:
        return 2 * m, 2 * m + 1
    return m, m + half


def _complex(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.complex(x[..., a].double(), x[..., b].double())


def measured_turn(k_raw: torch.Tensor, k_rot: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[rd/2]`` complex128: the factor each channel pair of ``k_raw [KVH, D]`` was turned by into
    ``k_rot [KVH, D]`` (least squares over the KV heads); NaN for a pair that is zero in every KV head
    (Gemma 3's ``k_norm`` zeroes some channels of every key), whose turn the key cannot show."""
    zr, zc = _complex(k_raw, a, b), _complex(k_rot, a, b)  # [KVH, rd/2]
    norm = (zr.abs() ** 2).sum(0)
    factor = (zc * zr.conj()).sum(0) / norm.clamp_min(1e-300)
    return torch.where(norm > 1e-24 * float(norm.max()), factor, torch.full_like(factor, complex("nan+nanj")))


def table_turn(cos: torch.Tensor, sin: torch.Tensor, position: int) -> torch.Tensor:
    """``[rd/2]`` complex128: the turn the node's own cos/sin tables ``[positions, rd/2]`` give ``position``."""
    return torch.complex(cos[position].double(), sin[position].double())


def apply_turn(x: torch.Tensor, factor: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` with each channel pair multiplied by ``factor [rd/2]`` (float32 out)."""
    z = _complex(x, a, b) * factor
    out = x.double().clone()
    out[..., a], out[..., b] = z.real, z.imag
    return out.to(torch.float32)


def check_scores(name: str, layer: int, q: torch.Tensor, k: torch.Tensor, scale: float, scores: torch.Tensor) -> float:
    """``scale * q K^T`` from the reconstructed query ``q [R, H, D]`` and the read keys ``k [N, KVH, D]``
    against the kernel's own ``scores [H, R, N]`` (AdapterError past :data:`SCORE_TOLERANCE`); the error."""
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)  # [N, H, D]
    mine = scale * torch.einsum("rhd,nhd->hrn", q.double(), kk)
    err = float((mine - scores.double()).abs().max() / max(1.0, float(scores.abs().max())))
    if err > SCORE_TOLERANCE:
        raise AdapterError(
            name,
            f"layer {layer} query",
            f"scale*q*K^T within {SCORE_TOLERANCE} of the kernel's qk_output",
            f"{err:.3g}",
        )
    return err
