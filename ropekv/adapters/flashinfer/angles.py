"""The angle FlashInfer's in-kernel RoPE turns a key by, relative to the query, at long positions.

The kernel computes each token's angle ``i * inv_freq`` in float32 (``inv_freq`` with fast-math
``__powf``) and its cosine and sine with ``__sincosf``. What matters to attention is the relative phase
of key ``j`` seen from the query at ``p``: exactly ``(j - p) * w_m`` for channel pair ``m``. This probe
measures it. A request of ``p + 1`` entries holds one key at index ``j`` (all others zero), whose every
channel pair is ``(1, 0)``; the query of a probe request is ``alpha (cos t, sin t)`` on one pair, for
:data:`DIRECTIONS` directions ``t``. The score is ``alpha * A * cos(phi - t)`` with ``phi`` the pair's phase
as the kernel rotated it, and the probe reads it from the base-2 log-sum-exp as
:mod:`~ropekv.adapters.flashinfer.probe` does (``p`` zero keys add ``p``). Directions whose score stands
well above ``ln p`` (:data:`MIN_SCORE`) are fitted by least squares to ``a cos t + b sin t``:
``phi = atan2(b, a)``, ``A = |(a, b)|`` (with the queries' components as rounded to the kernel's dtype).

:func:`float32_phase` is the same relative phase as transformers computes it (``inv_freq`` and the
product in float32, an accurate cosine and sine): the baseline FlashInfer is compared with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import UsageError
from .pages import PageTable

DIRECTIONS = 16
ALPHA = 16.0  # the key's pairs have norm 1: scores up to 16
MIN_SCORE = 9.0  # exp(9) = 8103: with up to 2**17 zero keys, a float32 lse2 still fixes s to ~1e-3


@dataclass(frozen=True, eq=False)
class AngleProbe:
    k_pages: torch.Tensor  # [2, page_size, KVH, D]: page 0 zero, page 1 the key at slot j % page_size
    v_pages: torch.Tensor
    table: PageTable  # pairs * DIRECTIONS requests of ``length`` entries
    q: torch.Tensor  # [pairs * DIRECTIONS, H, D]
    j: int
    length: int


def directions() -> torch.Tensor:
    return torch.arange(DIRECTIONS, dtype=torch.float64) * (2 * math.pi / DIRECTIONS)


def angle_probe(
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    page_size: int,
    j: int,
    length: int,
    dtype: torch.dtype,
    device: str,
) -> AngleProbe:
    """The probe of a key at index ``j`` of a request of ``length`` entries (query at ``length - 1``)."""
    if not 0 <= j < length:
        raise UsageError(f"angle probe: index {j} outside a request of {length} entries")
    half = head_dim // 2
    k_pages = torch.zeros(2, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    k_pages[1, j % page_size, :, :half] = 1.0  # every pair (1, 0)
    pages = [0] * (-(-length // page_size))
    pages[j // page_size] = 1
    n = half * DIRECTIONS
    table = PageTable.of([pages] * n, [length] * n, page_size, device=device)
    qd = query_directions(dtype)
    q = torch.zeros(half, DIRECTIONS, num_heads, head_dim, dtype=torch.float64)
    for m in range(half):
        q[m, :, :, m] = qd[:, 0, None]
        q[m, :, :, m + half] = qd[:, 1, None]
    return AngleProbe(
        k_pages, torch.zeros_like(k_pages), table, q.reshape(n, num_heads, head_dim).to(dtype).to(device), j, length
    )


def query_directions(dtype: torch.dtype) -> torch.Tensor:
    """``[DIRECTIONS, 2]`` float64: the probe queries' two components as the kernel reads them (``alpha cos t``,
    ``alpha sin t`` rounded to ``dtype``: the rounding would otherwise read as a phase error of ~1e-4)."""
    t = directions()
    return torch.stack([(ALPHA * torch.cos(t)).to(dtype).double(), (ALPHA * torch.sin(t)).to(dtype).double()], dim=1)


def phases_from(
    lse2: torch.Tensor, length: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lse2 [pairs * DIRECTIONS, H]`` of an :func:`angle_probe` in ``dtype`` -> each pair's phase (radians)
    and norm, float64 ``[pairs]``, read from query head 0 (every head sees the same key)."""
    half = head_dim // 2
    if lse2.shape[0] != half * DIRECTIONS:
        raise UsageError(f"phases_from: {lse2.shape[0]} rows, not {half} pairs x {DIRECTIONS} directions")
    ln = lse2[:, 0].double().reshape(half, DIRECTIONS) * math.log(2.0)
    excess = torch.exp(ln) - (length - 1)
    s = torch.log(excess.clamp_min(1e-300))
    design = query_directions(dtype)
    phase = torch.empty(half, dtype=torch.float64)
    norm = torch.empty(half, dtype=torch.float64)
    for m in range(half):
        keep = s[m] >= MIN_SCORE
        if int(keep.sum()) < 2:
            raise UsageError(f"phases_from: pair {m} has fewer than 2 well-resolved directions")
        x, y = torch.linalg.lstsq(design[keep], s[m][keep, None]).solution[:, 0]
        phase[m] = torch.atan2(y, x)
        norm[m] = torch.hypot(x, y)
    return phase, norm


def inv_freq64(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def exact_phase(head_dim: int, theta: float, j: int, p: int) -> torch.Tensor:
    """``[pairs]`` float64: the relative phase ``(j - p) * w_m`` of key ``j`` seen from the query at ``p``."""
    return (j - p) * inv_freq64(head_dim, theta)


def float32_phase(head_dim: int, theta: float, j: int, p: int) -> torch.Tensor:
    """The same, as transformers computes it: ``inv_freq`` in float32, ``position * inv_freq`` rounded to
    float32 for each token, an accurate rotation of those angles (float64 here)."""
    inv = (1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))).float()
    angle = torch.tensor([float(j), float(p)], dtype=torch.float32)[:, None] * inv  # float32 products
    return angle[0].double() - angle[1].double()


def wrapped(x: torch.Tensor) -> torch.Tensor:
    """Angles folded into ``(-pi, pi]``."""
    return torch.remainder(x + math.pi, 2 * math.pi) - math.pi


@dataclass(frozen=True)
class AngleErrors:
    """One probed key, against the exact relative phase: the largest error over channel pairs."""

    p: int
    j: int
    kernel: float  # max |phase error| of the kernel's rotation (radians)
    worst_pair: int
    float32: float  # the same for transformers' float32 angles
    norm: float  # max |pair norm - 1| as the kernel rotated it


def angle_errors(lse2: torch.Tensor, head_dim: int, theta: float, j: int, p: int, dtype: torch.dtype) -> AngleErrors:
    """What the probe of key ``j`` with the query at ``p`` (:func:`angle_probe`, length ``p + 1``) says."""
    phase, norm = phases_from(lse2, p + 1, head_dim, dtype)
    exact = exact_phase(head_dim, theta, j, p)
    err = wrapped(phase - exact).abs()
    f32 = wrapped(float32_phase(head_dim, theta, j, p) - exact).abs()
    return AngleErrors(p, j, float(err.max()), int(err.argmax()), float(f32.max()), float((norm - 1).abs().max()))
