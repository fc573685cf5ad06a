#!/usr/bin/env python3
"""Pack what the FlashInfer GPU check carries to the GPU machine (CPU only; no flashinfer needed).

    python scripts/flashinfer_pack.py --out DIR [--wheel flashinfer_python-0.2.14.post1-py3-none-any.whl]

writes ``DIR/bundle/weights.safetensors`` (the default model's first ``--layers`` layers with weights
rounded to float16, the embedding rows of the check's token stream, the cases), a copy of the
``ropekv`` package (the GPU script imports ``ropekv.adapters.flashinfer``), ``scripts/flashinfer_gpu.py``
and, if given, the flashinfer wheel. FlashInfer 0.2.14.post1 is published as a source package whose
build needs torch; its pure-Python wheel is made here with

    pip download --no-deps --no-binary=:all: --no-build-isolation flashinfer-python==0.2.14.post1
    pip wheel --no-deps --no-build-isolation flashinfer_python-0.2.14.post1.tar.gz

in an environment with ``setuptools>=77`` (docs/engines/flashinfer.md).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ropekv.adapters.flashinfer.bundle import BundleCase, save_bundle  # noqa: E402
from ropekv.adapters.flashinfer.pack import make_bundle, truncated_checkpoint  # noqa: E402
from ropekv.models.default import default_checkpoint  # noqa: E402

# The cases the GPU runs (no prefix hit): prompts ending 8 entries into a page of 16, and on the first
# entry of a page of 7 (position 28), decoded 3 steps into those pages.
CASES = (BundleCase(length=40, block_size=16, decode_steps=3), BundleCase(length=29, block_size=7, decode_steps=3))
LAYERS = 4
WEIGHT_DTYPE = "float16"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the folder to fill (e.g. the lead checkout's .gpu/)")
    parser.add_argument("--wheel", help="the flashinfer wheel to carry")
    parser.add_argument("--layers", type=int, default=LAYERS)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    truncated = truncated_checkpoint(default_checkpoint(), args.layers, WEIGHT_DTYPE)
    path = save_bundle(make_bundle(truncated, list(CASES), WEIGHT_DTYPE), out / "bundle")
    print(f"bundle: {path} ({path.stat().st_size / 2**20:.1f} MiB), model fingerprint {truncated.fingerprint}")
    pkg = out / "ropekv"
    if pkg.exists():
        shutil.rmtree(pkg)
    shutil.copytree(ROOT / "ropekv", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "scripts" / "flashinfer_gpu.py", out / "flashinfer_gpu.py")
    if args.wheel:
        shutil.copy2(args.wheel, out / Path(args.wheel).name)
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: {total / 2**20:.1f} MiB in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
