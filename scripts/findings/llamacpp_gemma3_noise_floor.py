"""Finding: llama.cpp's noise floor on Gemma 3 270M, the Q4_K_M file against the same weights written as
float32, with f32 and f16 KV caches. Run from .venv-llamacpp:

    .venv-llamacpp/bin/python scripts/findings/llamacpp_gemma3_noise_floor.py [--gguf PATH] [--lengths 513,600]

For each weight type and KV type, per prompt length L (3 decode steps after it), as for SmolLM2's Q4_1
(scripts/findings/llamacpp_noise_floor.py):
- batched vs one-by-one: the decode steps' logits after a one-by-one prefill (one token per llama_decode)
  against the same rows of one batched evaluation of the whole sequence (one ubatch);
- f16 vs f32 KV: the batched logits with an f16 cache against an f32 cache (same weights);
- against ropekv's float64 reference on the weights the file holds (dequantized): max |dlogit| and its
  scale-aware form (what the tolerance bounds), the attention-score error (scale-aware) at layer 0
  (sliding), layer 5 (global) and the worst layer.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from llamacpp_noise_floor import decode_errors_by_layer

from ropekv.adapters.llamacpp import LlamaCppEngine
from ropekv.adapters.llamacpp.f32_gguf import default_f32_gguf
from ropekv.models.default import default_gguf_path
from ropekv.models.reference import ReferenceDecoder
from ropekv.parity.cases import Case, token_stream
from ropekv.parity.compare import LogitsOf, scaled_error

GGUF = default_gguf_path("gemma3-270m")  # Gemma 3 270M, the original Q4_K_M file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=str(GGUF))
    ap.add_argument("--lengths", default="513,600")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    results = []
    for weights, path in (("f32", default_f32_gguf(args.gguf)), ("Q4_K_M", Path(args.gguf))):
        engines = {kv: LlamaCppEngine(path, type_k=kv, type_v=kv, tier="attention") for kv in ("f32", "f16")}
        cfg = engines["f32"].config
        tokens = token_stream(cfg.vocab_size, max(lengths) + 3)
        rows = [t for L in lengths for t in range(L, L + 3)]
        ref = ReferenceDecoder(engines["f32"].checkpoint).forward(tokens, probe_rows=rows, logits_for="probed")
        rows_of = {t: i for i, t in enumerate(rows)}
        of = LogitsOf(cfg, None, 0)
        for L in lengths:
            batched = engines["f32"].full_forward(tokens[: L + 3], list(range(L, L + 3)), Case(length=L))
            for kv, eng in engines.items():
                t0 = time.perf_counter()
                one_by_one = eng.run_case(Case(length=L, chunk=1), tokens)
                batched_kv = eng.full_forward(tokens[: L + 3], list(range(L, L + 3)), Case(length=L))
                run = eng.run_case(Case(length=L), tokens)
                dlogit, per_layer = decode_errors_by_layer(run, ref, rows_of, of)
                worst = max(range(len(per_layer)), key=lambda i: per_layer[i])
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
                    "logits_scaled_vs_float64": max(
                        scaled_error(s.logits, ref.logits[rows_of[s.position]]) for s in run.steps
                    ),
                    "attn_layer0_vs_float64": per_layer[0],
                    "attn_layer5_vs_float64": per_layer[5],
                    "attn_worst_vs_float64": per_layer[worst],
                    "worst_layer": worst,
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
