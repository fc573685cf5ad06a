"""Finding: llama.cpp's noise floor on the embedded SmolLM2 file, Q4_1 weights against the same weights
written as float32, with f32 and f16 KV caches. Run from .venv-llamacpp:

    .venv-llamacpp/bin/python scripts/findings/llamacpp_noise_floor.py [--lengths 17,100,600] [--json out.json]

For each weight type and KV type, per prompt length L (3 decode steps after it):
- batched vs one-by-one: the decode steps' logits after a one-by-one prefill (one token per llama_decode)
  against the same rows of one batched evaluation of the whole sequence (one ubatch);
- f16 vs f32 KV: the decode steps' logits with an f16 cache against an f32 cache (same weights);
- against ropekv's float64 reference on the weights the file holds (dequantized): max |dlogit|, and the
  attention-score error (scale-aware) at layer 0 and at the worst layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from ropekv.adapters.llamacpp import LlamaCppEngine
from ropekv.models.default import default_gguf_path
from ropekv.models.reference import ReferenceDecoder
from ropekv.parity.cases import Case, token_stream
from ropekv.parity.compare import LogitsOf, scaled_error


def reference_scores(ref, layer: int, i: int, of: LogitsOf) -> torch.Tensor:
    """The float64 reference's attention logits ``[H, T]`` of its probed row ``i``."""
    probe = ref.layers[layer]
    return of.rows(layer, dataclasses.replace(probe, q=probe.q[i : i + 1]), ref.rows[i : i + 1])[:, 0]


def decode_errors_by_layer(run, ref, rows_of, of) -> tuple[float, list[float]]:
    """max |dlogit| vs the reference (probed rows, in ``rows_of`` order), and each layer's worst
    attention error (scale-aware) over the case's decode steps."""
    dlogit, per_layer = 0.0, [0.0] * len(run.steps[0].layers)
    for step in run.steps:
        t = step.position
        dlogit = max(dlogit, float((step.logits.double() - ref.logits[_logits_row(ref, t, rows_of)]).abs().max()))
        for i, lp in enumerate(step.layers):
            mine = of.step(i, lp, t)
            theirs = reference_scores(ref, i, rows_of[t], of)[:, lp.key_positions]
            per_layer[i] = max(per_layer[i], scaled_error(mine, theirs))
    return dlogit, per_layer


def _logits_row(ref, t: int, rows_of) -> int:
    return rows_of[t] if ref.probed_logits else t


def decode_errors(run, ref, rows_of, of):
    """max |dlogit| vs the reference, layer-0 and worst-layer attention error, per case."""
    dlogit, per_layer = decode_errors_by_layer(run, ref, rows_of, of)
    return dlogit, per_layer[0], max(per_layer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="17,100,600")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    results = []
    for weights, path in (("f32", None), ("Q4_1", default_gguf_path())):
        engines = {kv: LlamaCppEngine(path, type_k=kv, type_v=kv, tier="attention") for kv in ("f32", "f16")}
        cfg = engines["f32"].config
        tokens = token_stream(cfg.vocab_size, max(lengths) + 3)
        rows = [t for L in lengths for t in range(L, L + 3)]
        ref = ReferenceDecoder(engines["f32"].checkpoint).forward(tokens, probe_rows=rows)
        rows_of = {t: i for i, t in enumerate(rows)}
        of = LogitsOf(cfg, None, 0)
        for L in lengths:
            batched = engines["f32"].full_forward(tokens[: L + 3], list(range(L, L + 3)), Case(length=L))
            for kv, eng in engines.items():
                t0 = time.perf_counter()
                one_by_one = eng.run_case(Case(length=L, chunk=1), tokens)
                batched_kv = eng.full_forward(tokens[: L + 3], list(range(L, L + 3)), Case(length=L))
                run = eng.run_case(Case(length=L), tokens)
                dlogit, l0, worst = decode_errors(run, ref, rows_of, of)
                row = {
                    "weights": weights,
                    "kv": kv,
                    "L": L,
                    "batched_vs_one_by_one": max(
                        float((a.logits - b).abs().max()) for a, b in zip(one_by_one.steps, batched_kv.logits)
                    ),
                    "argmax_equal": all(
                        int(a.logits.argmax()) == int(b.argmax()) for a, b in zip(one_by_one.steps, batched_kv.logits)
                    ),
                    "kv_vs_f32_kv": max(float((a - b).abs().max()) for a, b in zip(batched_kv.logits, batched.logits)),
                    "dlogit_vs_float64": dlogit,
                    "attn_layer0_vs_float64": l0,
                    "attn_worst_vs_float64": worst,
                    "seconds": round(time.perf_counter() - t0, 1),
                }
                results.append(row)
                print(
                    " ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
