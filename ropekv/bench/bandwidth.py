"""Memory bandwidth of this machine, measured with the thread count the engines use.

A decode step of a small model is bound by memory, not arithmetic: it must read every weight once
and the KV cache up to its context. The fastest any kernel can stream memory is therefore the
physical limit for tokens/s. Three kernels stream a buffer larger than the last-level cache; the
best rate among them is the bandwidth (the most demanding limit to hold an engine to):

- ``sum``: a reduction over a float32 buffer (pure reads);
- ``matvec``: ``torch.mv`` over a float32 matrix, the very kernel shape of a decode step's projections;
- ``copy``: ``dst.copy_(src)``, counted as bytes read plus bytes written.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def measure_bandwidth(nbytes: int, repeats: int = 5) -> dict[str, Any]:
    """Best-of-``repeats`` rate of each kernel over ``nbytes``-byte float32 buffers, in bytes/s."""
    if nbytes < 1 << 20:
        raise ValueError(f"bandwidth buffer of {nbytes} bytes is too small to leave the caches")
    numel = nbytes // 4
    cols = 4096
    rows = max(1, numel // cols)
    matrix = torch.ones(rows, cols)  # [rows, cols] float32; touched now so page faults are not timed
    vector = torch.ones(cols)
    flat = matrix.view(-1)
    dst = torch.empty_like(flat)
    kernels = {
        "sum": (lambda: flat.sum(), flat.numel() * 4),
        "matvec": (lambda: torch.mv(matrix, vector), matrix.numel() * 4),
        "copy": (lambda: dst.copy_(flat), 2 * flat.numel() * 4),
    }
    out: dict[str, Any] = {"buffer_bytes": flat.numel() * 4, "repeats": repeats, "kernels": {}}
    for name, (fn, moved) in kernels.items():
        fn()  # warm: first-touch of dst, thread pool start
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out["kernels"][name] = {
            "bytes_moved": moved,
            "best_seconds": min(times),
            "bytes_per_s": moved / min(times),
            "seconds": times,
        }
    best = max(out["kernels"], key=lambda k: out["kernels"][k]["bytes_per_s"])
    out["best_kernel"] = best
    out["bytes_per_s"] = out["kernels"][best]["bytes_per_s"]
    return out
