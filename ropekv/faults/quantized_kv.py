"""Faults of an 8-bit KV cache (vLLM's ``kv_cache_dtype=fp8``): codes read under the wrong scale, or
keys quantized at the wrong side of RoPE. Each is a :class:`~ropekv.cache.policy.CacheOpPolicy`
subclass handed to the cache; the engine runs under an ``float8_e4m3fn`` contract
(:class:`~ropekv.contract.KvQuant`), per-tensor scales unless ``--kv-scale`` says otherwise.

- ``fp8-scales-dropped-on-prefix-hit``: the rows a request reuses from a prefix-cache hit are
  dequantized with scale 1 (a fresh request's default) instead of the scale they were written under:
  the first request is right, every later one that hits the cache reads its prefix ``1 / s`` too
  large (SGLang #24198: "first request right, later ones garbage").
- ``fp8-scales-of-another-layer``: layer ``i`` dequantizes with layer ``i + 1``'s scales (the last
  layer with layer 0's): an off-by-one in the per-layer scale list.
- ``fp8-quantized-after-rope``: the contract stores raw keys (quantized before RoPE, rotated on read
  by the attention kernel), but the writer rotates them in its quantize kernel (a fused
  RoPE + quantize + cache-write kernel, as FlashInfer's ``rope_quantize_fp8``): the reader rotates the
  dequantized keys once more. Named by what the kernel sees: keys at twice their position.
- ``fp8-quantized-before-rope``: the reverse: the contract stores rotated keys (quantized after RoPE,
  vLLM's order), but the writer quantizes the key before the rotary kernel (a quantize fused into
  the key projection's epilogue): the cache holds codes of raw keys that no reader rotates.
"""

from __future__ import annotations

import torch

from ..cache.policy import CacheOpPolicy
from ..models.config import Checkpoint
from ..parity.cases import Case
from .native import NativeFault


class ScalesDroppedOnPrefixHit(CacheOpPolicy):
    """Rows reused from a prefix-cache hit are dequantized with scale 1, the rest with their layer's."""

    name = "fp8-scales-dropped-on-prefix-hit"

    def read_scales(self, layer, scales, inherited):
        k, v = super().read_scales(layer, scales, inherited)
        one = torch.ones((), dtype=torch.float32)
        rows = inherited[:, None].to(k.device)  # [N, 1]
        return torch.where(rows, one, k[None, :]), torch.where(rows, one, v[None, :])  # [N, S]


class ScalesOfAnotherLayer(CacheOpPolicy):
    """Layer ``i`` dequantizes with the scales of layer ``(i + 1) mod num_layers``."""

    name = "fp8-scales-of-another-layer"

    def read_scales(self, layer, scales, inherited):
        return super().read_scales((layer + 1) % len(scales), scales, inherited)


class QuantizedAfterRope(CacheOpPolicy):
    """A raw-key cache whose writer turns the keys to their positions before quantizing them."""

    name = "fp8-quantized-after-rope"

    def quantized_keys(self, rope, keys, positions):
        return keys if rope is None else rope.rotate(keys.to(torch.float64), positions.cpu()).to(keys.dtype)


class QuantizedBeforeRope(CacheOpPolicy):
    """A rotated-key cache whose writer quantizes the keys before the rotary kernel turned them."""

    name = "fp8-quantized-before-rope"

    def quantized_keys(self, rope, keys, positions):
        return keys if rope is None else rope.unrotate(keys.to(torch.float64), positions.cpu()).to(keys.dtype)


APART = 4.0  # how much larger every odd layer's keys and values are in :func:`layers_apart`


def layers_apart(ckpt: Checkpoint, factor: float = APART) -> Checkpoint:
    """The same function with every odd layer's keys and values ``factor`` times larger: its key
    projection (or key norm, where keys are normed) and value projection times ``factor``, its query
    projection (or query norm) and output projection divided by it, so every attention score and
    output is what it was. Adjacent layers' scales then differ ``factor`` times, as a trained model's do
    while a random test model's layers are alike (two layers of one init: scales within 1.4x, where
    reading the other layer's scale stays inside fp8's noise). A model whose attention weights have
    other names (latent attention) is returned unchanged."""
    w = dict(ckpt.weights)
    for i in range(1, ckpt.config.num_layers, 2):
        at = f"model.layers.{i}.self_attn."
        normed = f"{at}k_norm.weight" in w
        up = [f"{at}k_norm.weight"] if normed else [f"{at}k_proj.weight", f"{at}k_proj.bias"]
        down = [f"{at}q_norm.weight"] if normed else [f"{at}q_proj.weight", f"{at}q_proj.bias"]
        up += [f"{at}v_proj.weight", f"{at}v_proj.bias"]
        down += [f"{at}o_proj.weight"]
        if not all(n in w for n in (up[0], down[0], f"{at}v_proj.weight", f"{at}o_proj.weight")):
            return ckpt
        for names, by in ((up, factor), (down, 1.0 / factor)):
            for n in names:
                if n in w:
                    w[n] = w[n] * by
    return Checkpoint.from_tensors(ckpt.config, w, source=f"{ckpt.source} (odd layers' keys and values x{factor:g})")


# A prefix-cache hit (the earlier request wrote the scales and the prefix), a prompt past it and two
# decode steps; the prefix is not block-aligned, so the hit shares a partial block too.
_PREFIX_HIT = (Case(length=12, prefix=9, block_size=4, decode_steps=2),)
_DECODE = (Case(length=17, block_size=7, decode_steps=2),)
_WHERE = "an fp8 KV cache (float8_e4m3fn, per-tensor scales)"

CATALOGUE: tuple[NativeFault, ...] = (
    NativeFault(
        name="fp8-scales-dropped-on-prefix-hit",
        kind="kv_scale_mismatch",
        description=f"{_WHERE}: the rows of a prefix-cache hit are dequantized with scale 1 (SGLang #24198)",
        key_form="rotated",
        shows_when="a prefix-cache hit (the request that wrote the prefix is right)",
        cache_ops=ScalesDroppedOnPrefixHit,
        kv_dtype="fp8",
        exposing=_PREFIX_HIT,
    ),
    NativeFault(
        name="fp8-scales-of-another-layer",
        kind="kv_scale_mismatch",
        description=f"{_WHERE}: layer i dequantizes with layer i + 1's scales (odd layers' KV 4x larger, same function)",
        key_form="rotated",
        shows_when="any read of cached rows (the first decode; a model of two layers or more)",
        cache_ops=ScalesOfAnotherLayer,
        kv_dtype="fp8",
        model=layers_apart,
        exposing=_DECODE,
    ),
    NativeFault(
        name="fp8-quantized-after-rope",
        kind="double_rotation",
        description=f"{_WHERE}, raw keys: the writer rotates keys before quantizing, the reader rotates again",
        key_form="raw",
        fixed_key_form=True,
        shows_when="any read of cached rows past position 0",
        cache_ops=QuantizedAfterRope,
        kv_dtype="fp8",
        exposing=_DECODE,
    ),
    NativeFault(
        name="fp8-quantized-before-rope",
        kind="missing_rotation",
        description=f"{_WHERE}, rotated keys: the writer quantizes keys before RoPE, no reader rotates them",
        key_form="rotated",
        fixed_key_form=True,
        shows_when="any read of cached rows past position 0",
        cache_ops=QuantizedBeforeRope,
        kv_dtype="fp8",
        exposing=_DECODE,
    ),
)
