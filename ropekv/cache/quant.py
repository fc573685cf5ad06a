"""8-bit KV storage: ``float8_e4m3fn`` keys and values with per-layer float32 scales.

A stored row is ``q = fp8(clamp(x / s, -448, 448))`` and reads back as ``x' = float(q) * s``; ``s`` is
one float32 per layer (``"per_tensor"``) or one per KV head (``"per_head"``), for keys and values
apart (:class:`LayerScales`). 448 is e4m3fn's largest finite value: torch's cast turns anything
beyond it into NaN (e4m3fn has no infinity), so values are clamped first and an outlier saturates.

When the scales are set: once per layer, at the cache's first write to that layer, from that write's
absolute maximum (vLLM's ``calculate_kv_scales``: a static per-layer scale taken from the first
forward, then kept for every later request), ``s = amax / range`` with ``range = 448 / 8``: 8x
headroom for later tokens larger than the first write's before they saturate, at no cost in relative
precision (e4m3 is a float format: its relative step is the same from 2^-6 to 448; only rows below
1/3584 of the first amax fall into its subnormals). vLLM's ranges (``K_SCALE_CONSTANT = 200``,
``V_SCALE_CONSTANT = 100``: 2.24x and 4.48x) saturated 94 of SmolLM2-135M's cached values in ropekv's
default matrix, where a one-token first write sets the scale, and put the correct engine's attention
error at 0.35 (per tensor) and 0.82 (per head) against float64 (docs/faults.md). Why static rather than per write: per-write scales would have to be
stored per row range and carried by every fork, save and transfer row by row; one scale per layer
is what vLLM's fp8 cache holds (``layer._k_scale``, ``layer._v_scale``) and what SGLang's lost on a
prefix-cache hit (docs/faults.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..contract import KV_SCALES, KvScale
from ..errors import ConfigError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value (torch.finfo(torch.float8_e4m3fn).max)
HEADROOM = 8.0  # how much larger than the first write's amax a later row may be before it saturates
K_RANGE = FP8_MAX / HEADROOM  # keys' first amax maps to 56
V_RANGE = FP8_MAX / HEADROOM  # values' first amax maps to 56
_MIN_AMAX = 1e-12  # an all-zero first write still gets a usable (tiny, positive) scale


def _check_granularity(granularity: str) -> None:
    if granularity not in KV_SCALES:
        raise ConfigError(f"kv scale granularity must be one of {KV_SCALES}, got {granularity!r}")


def compute_scale(x: torch.Tensor, granularity: KvScale, quant_range: float) -> torch.Tensor:
    """The scale of rows ``x [N, KVH, D]``: ``amax / quant_range`` in float32, ``[1]`` per tensor or
    ``[KVH]`` per head."""
    _check_granularity(granularity)
    a = x.detach().to(torch.float32).abs()
    amax = a.amax().reshape(1) if granularity == "per_tensor" else a.amax(dim=(0, 2))
    return amax.clamp_min(_MIN_AMAX) / quant_range


def _per_row(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``scale`` (``[S]``, or ``[N, S]`` one per row) broadcast against ``x [N, KVH, D]``."""
    s = scale.to(device=x.device, dtype=torch.float32)
    return s[..., None] if s.dim() == 2 else s[None, :, None]


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [N, KVH, D]`` (any float dtype) -> e4m3fn codes ``[N, KVH, D]``: ``x / scale``, clamped to
    +-448, cast (round to nearest even). ``scale [S]`` (S = 1 or KVH) or ``[N, S]``."""
    y = x.to(torch.float32) / _per_row(scale, x)
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Codes ``q [N, KVH, D]`` -> ``q * scale`` in ``dtype`` (float32 by default). ``scale`` as in
    :func:`quantize`."""
    return (q.to(torch.float32) * _per_row(scale, q)).to(dtype)


@dataclass(frozen=True, eq=False)
class LayerScales:
    """One layer's scales: ``k``/``v`` ``[S]`` float32 (S = 1 per tensor, KVH per head)."""

    k: torch.Tensor
    v: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("k", "v"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1 or t.numel() < 1:
                raise ConfigError(f"layer scales: {name} must be a 1-D float32 tensor, got {t!r}")
            if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
                raise ConfigError(f"layer scales: {name} must be finite and positive, got {t.tolist()}")

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor, granularity: KvScale) -> LayerScales:
        """The static scales a layer takes from its first write (``keys``/``values [N, KVH, D]``)."""
        return cls(compute_scale(keys, granularity, K_RANGE), compute_scale(values, granularity, V_RANGE))

    def same(self, other: LayerScales) -> bool:
        return torch.equal(self.k, other.k) and torch.equal(self.v, other.v)
