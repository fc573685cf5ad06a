"""Finding: which of Gemma 3's layers a context's ``rope_freq_base`` / ``rope_freq_scale`` reaches in
llama.cpp. Run from .venv-llamacpp:

    .venv-llamacpp/bin/python scripts/findings/llamacpp_gemma3_freq_base.py [--gguf PATH]

For contexts with the model's settings, ``rope_freq_base`` 20,000 and ``rope_freq_scale`` 0.5, one decode
step; the eval callback reads every layer's key RoPE node (``Kcur-N``) and prints the base and scale its
``op_params`` hold (what the kernel really turned the keys with; rope_params.RopeRun), per layer kind.
"""

from __future__ import annotations

import argparse

from ropekv.adapters.llamacpp import LlamaCppEngine, ggml
from ropekv.adapters.llamacpp.rope_params import RopeOverrides, RopeRun
from ropekv.adapters.llamacpp.tap import GraphTap
from ropekv.models.default import default_gguf_path

GGUF = default_gguf_path("gemma3-270m")  # Gemma 3 270M, the original Q4_K_M file


class RopeTap(GraphTap):
    """Records each layer's key RoPE arguments."""

    def __init__(self, lib, num_layers: int):
        super().__init__(lib, num_layers)
        self.runs: dict[int, RopeRun] = {}

    def _handle(self, t, ask: bool) -> bool:
        name = ggml.name_of(t)
        if ask and self.lib.op_name(t.op) == "ROPE" and name.startswith("Kcur-"):
            self.runs[int(name.split("-")[1])] = RopeRun.from_op_params(list(t.op_params))
        return super()._handle(t, ask)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=str(GGUF))
    args = ap.parse_args()
    eng = LlamaCppEngine(args.gguf, tier="logits", n_ctx=256)
    cfg = eng.config
    kinds = {i: cfg.layer_attentions[i].kind for i in range(cfg.num_layers)}
    print(f"model: sliding base {cfg.layer_rope(0).theta:g}, global base {cfg.layer_rope(5).theta:g}")
    for label, rope in (
        ("model defaults", RopeOverrides()),
        ("rope_freq_base 20000", RopeOverrides(freq_base=20000.0)),
        ("rope_freq_scale 0.5", RopeOverrides(freq_scale=0.5)),
    ):
        tap = RopeTap(eng._lib, cfg.num_layers)
        ctx = eng.context(16, tap, rope=rope)
        ctx.decode([2], [0], [True])
        for kind in ("sliding", "full"):
            seen = sorted({(r.freq_base, r.freq_scale) for i, r in tap.runs.items() if kinds[i] == kind})
            layers = [i for i in tap.runs if kinds[i] == kind]
            print(f"{label:<22} {kind:<8} layers {layers}: (freq_base, freq_scale) {seen}")
        del ctx


if __name__ == "__main__":
    main()
