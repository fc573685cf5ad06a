"""Tolerances of llama.cpp runs, per weight type and KV type, and why (docs/engines/llamacpp.md).

The harness's defaults are per compute dtype (:func:`ropekv.parity.compare.tolerance_for`). llama.cpp
needs its own because two of its noise sources are not RoPE and not the compute dtype:

- quantized weights (Q4_1, Q8_0, K-quants): ggml quantizes the *activations* to 8-bit blocks before
  every quantized matmul, so the engine's arithmetic is not the dequantized weights' arithmetic; any
  one-ulp difference upstream (another batch split, an f16 cache) flips block roundings. That noise
  floor is measured on the embedded Q4_1 file and the tolerance sits above it;
- an f16 KV cache: keys and values are rounded to 11 bits where the kernel reads them.

With float32 weights and an f32 cache, llama.cpp is a float32 engine and gets the float32 tolerance.
On quantized weights these tolerances only catch gross RoPE errors (an injected shift fault moves
layer-0 scores by 3.7 to 8.6, the Q4_1 noise reaches 0.06 to 0.3 scale-aware at some layer): there forensics (effective positions)
and the engine-vs-itself comparison at layer 0 are the evidence; the default check runs float32.
"""

from __future__ import annotations

from collections import Counter

from ...parity.compare import Tolerance

KV_TYPES = ("f32", "f16")

# (weights, kv) -> tolerance on scale-aware errors (max |diff| / max(1, max |ref|)); figures in the doc.
_TABLE = {
    # float32 weights, f32 cache: measured attention <= 4e-5, logits <= 1e-4 abs (float32 tolerance).
    ("f32", "f32"): Tolerance(attn=2e-3, hidden=2e-3, logits=5e-3),
    # f16 cache: measured attention <= 4.7e-3, logits <= 1e-2 abs (L = 17..600).
    ("f32", "f16"): Tolerance(attn=2e-2, hidden=2e-2, logits=5e-2),
    # Q4_1, f32 cache: measured attention <= 6.1e-2, logits <= 0.94 abs (~0.05 scale-aware); 2.5x margin.
    ("quantized", "f32"): Tolerance(attn=1.5e-1, hidden=1.5e-1, logits=1.5e-1),
    # Q4_1, f16 cache: measured attention up to 0.30 at L = 600 (deep layers), logits <= 1.2 abs.
    ("quantized", "f16"): Tolerance(attn=6e-1, hidden=6e-1, logits=2e-1),
}


def weight_kind(reader) -> str:
    """``"f32"`` when every 2-D weight of the GGUF is float32, else the most common other type's name."""
    types = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2)
    others = {k: v for k, v in types.items() if k != "F32"}
    return "f32" if not others else max(others, key=lambda k: others[k])


def tolerance_for_run(weights: str, type_k: str, type_v: str) -> Tolerance:
    kv = "f32" if type_k == type_v == "f32" else "f16"
    return _TABLE[("f32" if weights == "f32" else "quantized", kv)]
