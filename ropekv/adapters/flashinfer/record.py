"""One recording: every case of a bundle, and the full forward, driven through a kernel in one setup.

Used by the GPU script (``scripts/flashinfer_gpu.py``, with :class:`~.kernel.FlashInferKernel`) and by
the tests (with :class:`~.cpu_kernel.CpuPagedKernel`); the result is what
:class:`~.replay.FlashInferReplayAdapter` reads.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .bundle import DTYPE_NAMES, Bundle
from .driver import Setup, run_cached, run_full
from .kernel import PagedKernel
from .model import LlamaLayers


def record(
    kernel: PagedKernel, bundle: Bundle, dtype: str, setup: Setup, device: str = "cpu"
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and metadata of one recording: cases ``c0.``, ``c1.``, ... and ``full.``."""
    torch_dtype = DTYPE_NAMES[dtype]
    model = LlamaLayers(bundle.weights, bundle.shapes, device)
    embeddings = bundle.embeddings.to(device=device, dtype=torch.float32)
    tensors: dict[str, torch.Tensor] = {"tokens": bundle.tokens}
    t0 = time.perf_counter()
    for i, c in enumerate(bundle.cases):
        rec = run_cached(kernel, model, embeddings, c.length, c.block_size, c.decode_steps, setup, torch_dtype)
        tensors.update({f"c{i}.{k}": v for k, v in rec.items()})
    rows = bundle.full_rows
    full = run_full(kernel, model, embeddings[: max(rows) + 1], rows, bundle.cases[0].block_size, setup, torch_dtype)
    tensors.update(full)
    if device != "cpu":
        torch.cuda.synchronize()
    meta = {
        "setup": setup.name,
        "dtype": dtype,
        "cases": [c.__dict__ for c in bundle.cases],
        "fingerprint": bundle.meta.get("fingerprint"),
        "model": bundle.meta.get("model"),
        "kernel": kernel.name,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    return tensors, meta
