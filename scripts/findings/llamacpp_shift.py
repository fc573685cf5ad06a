"""Finding: llama.cpp's context shift (llama_memory_seq_add) on the embedded SmolLM2, float32 GGUF and
the original Q4_1 file, against explicit positions and ropekv's float64 reference; then the two shift
faults injected into the running K-shift. Run from .venv-llamacpp:

    .venv-llamacpp/bin/python scripts/findings/llamacpp_shift.py [--deltas 10,1000,4000] [--n 64] [--json out.json]

Columns: max |dlogit| shifted vs explicit positions, each against float64; max |d score| at layer 0
(shifted vs explicit, shifted vs float64) and at the last layer; what forensics says about the keys.
"""

from __future__ import annotations

import argparse
import json
import time

from ropekv.adapters.llamacpp import LlamaCppEngine
from ropekv.adapters.llamacpp.shift import check_shift
from ropekv.adapters.llamacpp.tap import ShiftFaultKind
from ropekv.models.default import default_gguf_path
from ropekv.models.reference import ReferenceDecoder
from ropekv.parity.cases import token_stream


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deltas", default="10,1000,4000")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    deltas = [int(x) for x in args.deltas.split(",")]
    rows = []
    for weights, path in (("f32", None), ("Q4_1", default_gguf_path())):
        engine = LlamaCppEngine(path, n_ctx=max(deltas) + args.n + 64, tier="forensics")
        reference = ReferenceDecoder(engine.checkpoint)
        tokens = token_stream(engine.config.vocab_size, args.n + 1).tolist()
        runs: list[tuple[int, ShiftFaultKind | None]] = [(d, None) for d in deltas] + (
            [(1000, "not_rerotated"), (1000, "rerotated_twice")] if weights == "f32" else []
        )
        for delta, fault in runs:
            t0 = time.perf_counter()
            c = check_shift(engine, reference, tokens, args.n, delta, fault=fault)
            row = {
                "weights": weights,
                "fault": fault or "-",
                **c.to_dict(),
                "seconds": round(time.perf_counter() - t0, 1),
            }
            row["last_layer_scores_vs_reference"] = c.scores_vs_reference[-1]
            row.pop("scores_vs_reference")
            rows.append(row)
            print(
                f"{weights:4s} delta={delta:5d} fault={row['fault']:16s} dlogit shifted-vs-explicit={c.logits_vs_explicit:.2e} "
                f"shifted-vs-f64={c.logits_vs_reference:.2e} explicit-vs-f64={c.explicit_vs_reference:.2e} | layer-0 scores "
                f"shifted-vs-explicit={c.layer0_scores_vs_explicit:.2e} shifted-vs-f64={c.layer0_scores_vs_reference:.2e} "
                f"explicit-vs-f64={c.explicit_layer0_vs_reference:.2e} last layer={c.scores_vs_reference[-1]:.2e} | "
                f"K-shifts run={c.shifts_seen} verdict={c.verdict} ({c.diagnosis.kind}: {c.diagnosis.evidence[:90]})",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
