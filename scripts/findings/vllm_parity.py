"""Finding: vLLM (CPU build) keeps RoPE parity on the embedded SmolLM2 across the issue's cases.

Runs ``ropekv.check`` on ``VLLMEngine`` for each dtype given (default float32 and bfloat16) over the
vLLM matrix (length 1; one below / at / above a 32-token block; prefix hits of one and two blocks and
of 45 tokens; a long prompt prefilled in 64-token chunks; 3 decode steps) and prints the report
table, vLLM's own prefix-cache counts and the start-up and check times.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 \
        .venv-vllm/bin/python scripts/findings/vllm_parity.py [--long 1500] [--json out/vllm.json] [float32 bfloat16]
"""

from __future__ import annotations

import argparse
import json
import time

if __name__ == "__main__":  # vLLM may spawn: keep start-up under the guard
    parser = argparse.ArgumentParser()
    parser.add_argument("dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--long", type=int, default=1500, help="length of the long, chunked case")
    parser.add_argument("--budget", type=int, default=64, help="max_num_batched_tokens (chunk size)")
    parser.add_argument("--json", help="write the reports as JSON")
    args = parser.parse_args()

    from ropekv import check
    from ropekv.adapters.vllm import VLLMEngine, vllm_cases

    out = {}
    for dtype in args.dtypes:
        t0 = time.perf_counter()
        engine = VLLMEngine(None, dtype=dtype, block_size=32, max_num_batched_tokens=args.budget, max_model_len=4096)
        started = time.perf_counter() - t0
        cases = vllm_cases(32, max_num_batched_tokens=args.budget, long_context=args.long, decode_steps=3)
        t0 = time.perf_counter()
        report = check(engine, cases=cases)
        took = time.perf_counter() - t0
        print(
            f"\n== vLLM {engine.vllm_version} {dtype} (kernel {engine.contract.kernel_isa}, top-{engine.top_k} "
            f"log-probabilities): start-up {started:.1f} s, check {took:.1f} s =="
        )
        print(report.table())
        for r in report.cases:
            print(
                f"  {r.case.label():28s} logprob err {r.max_abs_logit_diff:.2e}  attn err {r.max_attn_error:.2e}"
                f"  self attn err {r.max_self_attn_error:.2e}  {r.seconds:5.1f} s  | " + "; ".join(r.notes)
            )
        out[dtype] = json.loads(report.to_json())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
