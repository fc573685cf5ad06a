"""Finding: each RoPE bug patched into the ONNX graph onnxruntime-genai's builder made is caught and named,
inside a kernel that turns keys itself.

For every fault of ``ropekv.faults.ort`` the built graph is patched (``OrtFault.adapter``) and run
through onnxruntime-genai's own Generator at the forensics tier; ropekv's verdict is printed per fault:
the graph's contract against the model's (what the graph says before anything runs), max |dlogit|
against the float64 reference, the worst attention-logit error, the first divergent layer and the bug
class forensics names, with its evidence. The SmolLM2 faults run two cases (17 tokens; 40 after a
13-token prefix hit, chunked by 9); the window fault runs on Gemma 3 270M (520 tokens: 8 keys past the
512-key window), where dropping the window also drops the sliding buffers, so the forensics tier holds.

Run from .venv-ort:  OMP_NUM_THREADS=2 .venv-ort/bin/python scripts/findings/ort_faults.py
"""

from __future__ import annotations

import time

if __name__ == "__main__":
    from ropekv import check
    from ropekv.faults.ort import CATALOGUE
    from ropekv.parity.cases import Case

    smol = [Case(length=17, decode_steps=2), Case(length=40, prefix=13, chunk=9, decode_steps=2)]
    gemma = [Case(length=520, decode_steps=1)]
    for fault in CATALOGUE:
        model = "gemma3-270m" if fault.name == "ort-window-dropped" else None
        start = time.monotonic()
        engine = fault.adapter(model)
        report = check(engine, cases=gemma if model else smol)
        d = report.diagnosis
        worst = max(r.max_abs_logit_diff or 0.0 for r in report.cases)
        attn = max(r.max_attn_error or 0.0 for r in report.cases)
        layers = sorted({r.first_divergence.layer for r in report.cases if r.first_divergence})
        named = d.kind if d else "-"
        print(
            f"{fault.name} on {model or 'smollm2'} ({engine.tier} tier): passed={report.passed}; max|dlogit| "
            f"{worst:.3g}, attention {attn:.3g}, first divergent layer(s) {layers}; named {named} "
            f"(expected {fault.kind}) [{time.monotonic() - start:.0f} s]"
        )
        print(f"    graph vs model: {engine.graph_differences or 'no difference'}")
        if d:
            print(f"    evidence: {d.evidence}")
