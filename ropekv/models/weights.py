"""What identifies a checkpoint's weights and what makes them unusable, shared by every loader.

:func:`weights_digest` is the one digest of a set of float32 tensors that every path to a
checkpoint hashes (a safetensors directory, a GGUF file dequantized, a transformers model in memory,
the converted default model), so the same weights give the same model fingerprint whichever way
they were loaded. :func:`non_finite` finds a NaN or an infinity in one pass over a tensor, so a
loader can refuse it naming the tensor and the file instead of letting it surface later as a NaN key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import torch

_HASH_CHUNK = 16 * 1024 * 1024


def weights_digest(weights: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the sorted ``(name, shape, dtype, raw bytes)`` of every tensor.

    Loaders hash their tensors in float32 under ropekv's canonical names, so the digest depends on
    the values only, not on the file format, the folder or the dtype the file stored. Raw bytes are
    hashed through a zero-copy byte view, in chunks (about a second for the 540 MB of SmolLM2-135M).
    """
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().cpu().contiguous()
        h.update(json.dumps([name, list(t.shape), str(t.dtype)]).encode())
        view = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")
        for start in range(0, len(view), _HASH_CHUNK):
            h.update(view[start : start + _HASH_CHUNK])
    return h.hexdigest()


def weights_fingerprint_of(weights: Mapping[str, torch.Tensor]) -> str:
    """The weights' fingerprint: the first 16 hex digits of :func:`weights_digest`, over the tensors
    alone (no configuration), the value a cache contract's ``weights_fingerprint`` holds."""
    return weights_digest(weights)[:16]


def non_finite(tensor: torch.Tensor) -> str | None:
    """None when every value of ``tensor`` is finite, else what and where the first bad one is
    (``"NaN at [3, 5] (2 non-finite values)"``). One pass (``aminmax`` propagates NaN and shows an
    infinity as an extreme); the locating pass runs only for a bad tensor."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return None
    low, high = torch.aminmax(tensor.detach())
    if bool(torch.isfinite(low)) and bool(torch.isfinite(high)):
        return None
    bad = ~torch.isfinite(tensor.detach())
    count = int(bad.sum())
    flat = int(bad.reshape(-1).nonzero()[0, 0])
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat), tensor.shape)]
    value = float(tensor.reshape(-1)[flat])
    kind = "NaN" if value != value else ("+inf" if value > 0 else "-inf")
    return f"{kind} at {index} ({count} non-finite value{'s' if count != 1 else ''})"
