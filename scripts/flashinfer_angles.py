#!/usr/bin/env python3
"""Read FlashInfer's in-kernel rotation angles out of a GPU run (``flashinfer-angles.safetensors[.xz]``,
written by scripts/flashinfer_gpu.py) and compare them with the exact relative phase and with
transformers' float32 angles (``ropekv.adapters.flashinfer.angles``).

    python scripts/flashinfer_angles.py [docs/engines/flashinfer/flashinfer-angles.safetensors.xz]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ropekv.adapters.flashinfer.angles import angle_errors  # noqa: E402
from ropekv.adapters.flashinfer.bundle import DTYPE_NAMES, load_recording  # noqa: E402


def main() -> int:
    path = (
        Path(sys.argv[1])
        if len(sys.argv) > 1
        else ROOT / "docs" / "engines" / "flashinfer" / "flashinfer-angles.safetensors.xz"
    )
    tensors, meta = load_recording(path)
    if meta.get("kind") != "angles":
        print(f"{path}: not an angle recording", file=sys.stderr)
        return 2
    d, theta = int(meta["head_dim"]), float(meta["rope_theta"])
    print(f"{meta['flashinfer']} on {meta['device']} (CUDA {meta['cuda']}), head_dim {d}, rope_theta {theta:g}")
    print("max |phase error| over the channel pairs of a key at j seen from the query at p, radians")
    header = f"{'dtype':9} {'p':>7} {'j':>7} {'j - p':>8}  {'FlashInfer':>10} {'pair':>4}  {'float32 HF':>10}  {'|norm - 1|':>10}"
    print(header)
    print("-" * len(header))
    for dtype in meta["dtypes"]:
        for p in meta["positions"]:
            for j in (0, p // 2, p - 1):
                e = angle_errors(tensors[f"{dtype}.p{p}.j{j}"], d, theta, j, p, DTYPE_NAMES[dtype])
                print(
                    f"{dtype:9} {p:>7} {j:>7} {j - p:>8}  {e.kernel:>10.2e} {e.worst_pair:>4}  {e.float32:>10.2e}  {e.norm:>10.2e}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
