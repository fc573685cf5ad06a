"""Finding: each RoPE bug patched into vLLM's decode path is caught at every tier and named.

For every fault in ``ropekv.bugs.registry.VLLM_FAULTS`` the running engine is patched, one case with
a prefix-cache hit is run (length 40 after a 32-token prefix, 2 decode steps), and ropekv's verdict
is printed: logits error (top-k log-probabilities against the float64 reference), first divergent
layer, and the bug class forensics names.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 \
        .venv-vllm/bin/python scripts/findings/vllm_faults.py [float32|bfloat16]
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from ropekv import check
    from ropekv.adapters.vllm import VLLMEngine
    from ropekv.bugs.registry import VLLM_FAULTS as FAULTS
    from ropekv.faults.vllm import injected
    from ropekv.parity.cases import Case

    dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
    engine = VLLMEngine(None, dtype=dtype, block_size=32, num_gpu_blocks_override=96, max_model_len=2048)
    case = Case(length=40, prefix=32, block_size=32, decode_steps=2)
    print(f"vLLM {engine.vllm_version} {dtype}, case {case.label()}")
    print(f"{'fault':24s} {'logprob err':>11s} {'attn err':>9s} {'first layer':>11s}  named")
    for name, fault in FAULTS.items():
        with injected(engine, name):
            report = check(engine, cases=[case])
        r = report.cases[0]
        d = report.diagnosis
        print(
            f"{name:24s} {r.max_abs_logit_diff:11.3f} {r.max_attn_error:9.3f} "
            f"{r.first_divergence.layer if r.first_divergence else '-':>11}  {d.kind if d else '-'}"
            f"{'' if d and d.kind == fault.kind else '  (expected ' + fault.kind + ')'}"
        )
        if d:
            print(f"    {d.evidence[:160]}")
    clean = check(engine, cases=[case])
    print(
        f"{'(no fault)':24s} {clean.cases[0].max_abs_logit_diff:11.2e} {clean.cases[0].max_attn_error:9.2e} "
        f"{'-':>11}  passed={clean.passed}"
    )
