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
    # SmolLM2's Q4_1, f32 cache: measured attention <= 6.1e-2, logits <= 0.94 abs (~0.05 scale-aware); 2.5x margin.
    ("Q4_1", "f32"): Tolerance(attn=1.5e-1, hidden=1.5e-1, logits=1.5e-1),
    # SmolLM2's Q4_1, f16 cache: measured attention up to 0.30 at L = 600 (deep layers), logits <= 1.2 abs.
    ("Q4_1", "f16"): Tolerance(attn=6e-1, hidden=6e-1, logits=2e-1),
    # Gemma 3 270M's Q4_K_M (scripts/findings/llamacpp_gemma3_noise_floor.py, L = 513 and 600), f32
    # cache: measured attention <= 0.10 (deep layers; 1.2e-2 at layer 0), logits <= 1.7 abs (5.4e-2
    # scale-aware), batched vs one-by-one 1.3 to 1.5 abs; 2.5x margin.
    ("Q4_K_M", "f32"): Tolerance(attn=2.5e-1, hidden=2.5e-1, logits=1.5e-1),
    # f16 cache: measured attention <= 8.8e-2, logits <= 3.1 abs (9.9e-2 scale-aware).
    ("Q4_K_M", "f16"): Tolerance(attn=2.5e-1, hidden=2.5e-1, logits=2.5e-1),
}
# A quantized file type nobody measured gets Q4_1's rows (the first measured, as before file types
# were told apart); its own noise floor is what a new row needs (docs/engines/llamacpp.md).
_UNMEASURED = "Q4_1"
# llama_ftype values of general.file_type (llama.h), for the names the table and the reports use.
_FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    32: "BF16",
}


def weight_kind(reader) -> str:
    """``"f32"`` when every 2-D weight of the GGUF is float32, else the most common other type's name."""
    types = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2)
    others = {k: v for k, v in types.items() if k != "F32"}
    return "f32" if not others else max(others, key=lambda k: others[k])


def weights_name(reader) -> str:
    """``"f32"`` for an all-float32 file, else its ``general.file_type`` name (``"Q4_1"``, ``"Q4_K_M"``: a
    K-quant mix is named by its recipe, not by its most common tensor type), else :func:`weight_kind`."""
    kind = weight_kind(reader)
    if kind == "f32":
        return kind
    field = reader.fields.get("general.file_type")
    value = field.contents() if field is not None else None
    return _FILE_TYPES.get(value, kind) if isinstance(value, int) else kind


def tolerance_for_run(weights: str, type_k: str, type_v: str) -> Tolerance:
    """The tolerance of a run on ``weights`` (:func:`weights_name`) with these KV types."""
    kv = "f32" if type_k == type_v == "f32" else "f16"
    if weights == "f32":
        return _TABLE[("f32", kv)]
    return _TABLE.get((weights, kv), _TABLE[(_UNMEASURED, kv)])
