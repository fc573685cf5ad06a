#!/usr/bin/env python3
"""Judge the FlashInfer GPU check's recordings on CPU: ``ropekv.check`` against the float64 reference.

    python scripts/flashinfer_verdict.py [--recordings docs/engines/flashinfer] [--json DIR]

Rebuilds the truncated model the bundle was packed from (the default model's first 4 layers, weights
rounded to float16: scripts/flashinfer_pack.py), replays each ``flashinfer-*.safetensors[.xz]`` through
:class:`~ropekv.adapters.flashinfer.replay.FlashInferReplayAdapter` and prints ropekv's report. Exit 0
when every recording gets the verdict its setup must get (raw keys and the rotated-key control pass,
keys rotated before append fail and are named double_rotation), 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ropekv  # noqa: E402
from ropekv.adapters.flashinfer.pack import as_case, truncated_checkpoint  # noqa: E402
from ropekv.adapters.flashinfer.replay import EXPECTED, FlashInferReplayAdapter  # noqa: E402
from ropekv.models.default import default_checkpoint  # noqa: E402

LAYERS = 4  # as scripts/flashinfer_pack.py packed them
WEIGHT_DTYPE = "float16"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recordings", default=str(ROOT / "docs" / "engines" / "flashinfer"))
    parser.add_argument("--json", help="write each report's JSON into this folder")
    args = parser.parse_args()
    files = sorted(
        p for p in Path(args.recordings).glob("flashinfer-*.safetensors*") if p.suffix in (".safetensors", ".xz")
    )
    if not files:
        print(f"no flashinfer-*.safetensors[.xz] recordings in {args.recordings}", file=sys.stderr)
        return 2
    truncated = truncated_checkpoint(default_checkpoint(), LAYERS, WEIGHT_DTYPE)
    print(f"model: {truncated.config.name}, fingerprint {truncated.fingerprint}")
    wrong = []
    for path in files:
        t0 = time.perf_counter()
        adapter = FlashInferReplayAdapter(truncated, path)
        report = ropekv.check(adapter, cases=[as_case(c) for c in adapter.cases])
        print(f"\n== {path.name}: {adapter.name} ({report.tier} tier)")
        print(report.table())
        for c in report.judged:
            per_layer = [max(step[i] for step in c.attn_errors) for i in range(len(c.attn_errors[0]))]
            figures = ", ".join(f"layer {i} {e:.2e}" for i, e in enumerate(per_layer))
            print(f"{c.case.label()}: attention-logit error vs float64 per layer (worst step): {figures}")
        got = None if report.passed else (report.diagnosis.kind if report.diagnosis else "unnamed")
        want = EXPECTED[adapter.setup.name]
        verdict = "as expected" if got == want else f"EXPECTED {want or 'PASS'}"
        print(f"verdict: {got or 'PASS'} ({verdict}; judged in {time.perf_counter() - t0:.1f} s)")
        if got != want:
            wrong.append(path.name)
        if args.json:
            out = Path(args.json)
            out.mkdir(parents=True, exist_ok=True)
            (out / (path.name.split(".")[0] + ".json")).write_text(report.to_json())
    if wrong:
        print(f"\nunexpected verdicts: {', '.join(wrong)}")
        return 1
    print(f"\nall {len(files)} recordings judged as their setups require")
    return 0


if __name__ == "__main__":
    sys.exit(main())
