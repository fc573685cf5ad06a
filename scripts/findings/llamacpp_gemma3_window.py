"""Finding: which keys llama.cpp's sliding and global layers of Gemma 3 270M attend to past the window
(n_swa 512), and how close its post-RoPE keys are to ropekv's float64 reference. Run from .venv-llamacpp:

    .venv-llamacpp/bin/python scripts/findings/llamacpp_gemma3_window.py [--gguf PATH]

On the all-float32 GGUF of the file (so weights add no noise), for each context configuration
(n_batch 512 or 128: the prompt split into ubatches smaller than it; swa_full true, llama.cpp's
default, or false: the sliding layers' cache sized to the window plus one ubatch, its cells reused) and
each case (past the window by 88 tokens, twice over in chunks of 256, a 509-token prefix hit whose
suffix crosses the edge, a chunk across the edge), per decode step and layer 0 (sliding, base 10,000)
and layer 5 (global, base 1e6): the positions of the keys the kernel read (the layer's own mask over
its own cache's cells, read from the graph) against the reference's (sliding: the 512 positions
``t-511..t``; global: ``0..t``), and the scale-aware error of those keys and of the query against the
float64 reference's post-RoPE keys and query, and of the query before RoPE (after the q norm): what
the rotation adds is the difference of the two query columns.
"""

from __future__ import annotations

import argparse

from ropekv.adapters.llamacpp import LlamaCppEngine
from ropekv.adapters.llamacpp.f32_gguf import default_f32_gguf
from ropekv.models.default import default_gguf_path
from ropekv.models.reference import ReferenceDecoder
from ropekv.parity.cases import Case, token_stream
from ropekv.parity.compare import scaled_error

GGUF = default_gguf_path("gemma3-270m")  # Gemma 3 270M, the original Q4_K_M file
CASES = (Case(length=600), Case(length=1100, chunk=256), Case(length=91, prefix=509), Case(length=600, chunk=301))
LAYERS = (0, 5)


def expected_positions(cfg, layer: int, t: int) -> list[int]:
    window = cfg.layer_window(layer)
    return list(range(0 if window is None else max(0, t - window + 1), t + 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=str(GGUF))
    args = ap.parse_args()
    path = default_f32_gguf(args.gguf)
    tokens_needed = max(c.total for c in CASES)
    first = LlamaCppEngine(path, tier="attention", n_ctx=2048)
    cfg = first.config
    tokens = token_stream(cfg.vocab_size, tokens_needed)
    rows = sorted({t for c in CASES for t in c.decode_positions})
    ref = ReferenceDecoder(first.checkpoint).forward(tokens, probe_rows=rows, logits_for="probed")
    row_of = {t: i for i, t in enumerate(rows)}
    print(
        f"{path.name}: layer windows {[cfg.layer_window(i) for i in LAYERS]}, bases {[cfg.layer_rope(i).theta for i in LAYERS]}"
    )
    print(
        f"{'n_batch':>7} {'swa_full':>8} {'case':<18} {'layer':>5} {'keys read':>16} {'= reference':>11} {'key err':>9} {'q err':>9} {'q pre-RoPE':>10} {'dlogit':>9}"
    )
    for n_batch in (512, 128):
        for swa_full in (True, False):
            eng = LlamaCppEngine(path, tier="attention", n_ctx=2048, n_batch=n_batch)
            eng._cached = eng.context(n_batch, eng.tap, swa_full=swa_full)
            for case in CASES:
                run = eng.run_case(case, tokens)
                for layer in LAYERS:
                    same, kerr, qerr, qraw, spans, dlogit = True, 0.0, 0.0, 0.0, set(), 0.0
                    for step in run.steps:
                        t, lp = step.position, step.layers[layer]
                        got = sorted(int(p) for p in lp.key_positions)
                        want = expected_positions(cfg, layer, t)
                        same &= got == want
                        spans.add(f"{got[0]}..{got[-1]} ({len(got)})")
                        order = lp.key_positions.argsort()
                        kerr = max(kerr, scaled_error(lp.k[order], ref.layers[layer].k[sorted(got)]))
                        qerr = max(qerr, scaled_error(lp.q, ref.layers[layer].q[row_of[t] : row_of[t] + 1]))
                        qraw = max(qraw, scaled_error(lp.q_raw, ref.layers[layer].q_raw[row_of[t] : row_of[t] + 1]))
                        dlogit = max(dlogit, float((step.logits.double() - ref.logits[row_of[t]]).abs().max()))
                    span = sorted(spans)[-1]
                    name = f"L={case.length} P={case.prefix}" + (f" c={case.chunk}" if case.chunk else "")
                    print(
                        f"{n_batch:>7} {str(swa_full):>8} {name:<18} {layer:>5} {span:>16} {str(same):>11} "
                        f"{kerr:9.2e} {qerr:9.2e} {qraw:10.2e} {dlogit:9.2e}",
                        flush=True,
                    )
            del eng


if __name__ == "__main__":
    main()
