"""The checkpoint ropekv's reference judges vLLM with: the same directory, read by ropekv's own loader.

vLLM's CPU build repacks its linear weights for its GEMM kernels after loading (``qkv_proj.weight``
is left empty), so the parameters cannot be read back from the model object. ropekv reads the same
``config.json`` and safetensors itself (safetensors only, validated) and, for a bfloat16 engine,
rounds every weight to bfloat16 as vLLM's loader does, so the float64 reference multiplies the
weights vLLM multiplies and the comparison measures arithmetic, not the rounding of weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...models import load_checkpoint
from ...models.config import Checkpoint, fingerprint_of
from ...models.weights import weights_digest


def checkpoint_for(model_dir: Path, dtype: torch.dtype, *, default: bool) -> Checkpoint:
    """``model_dir`` as a float32 :class:`Checkpoint` holding the values vLLM runs in ``dtype``."""
    checkpoint = load_checkpoint(None if default else model_dir)
    if dtype == torch.float32:
        return checkpoint
    weights = {name: t.to(dtype).to(torch.float32) for name, t in checkpoint.weights.items()}
    return Checkpoint(
        checkpoint.config,
        weights,
        f"{checkpoint.source} (weights rounded to {dtype} as vLLM loads them)",
        fingerprint_of(checkpoint.config, weights_digest(weights)),  # what any loader of these values gives
    )
