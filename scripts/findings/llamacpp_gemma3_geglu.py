"""Finding: on the all-float32 Gemma 3 GGUF, llama.cpp's GEGLU (gelu_pytorch_tanh(gate) * up) is not a
float32 computation: its error against float64 on llama.cpp's own inputs is that of rounding the gate
to float16 first (ggml's CPU GELU reads a float16 lookup table). Run from .venv-llamacpp:

    .venv-llamacpp/bin/python scripts/findings/llamacpp_gemma3_geglu.py [--gguf PATH]

The eval callback reads, for every layer of one 64-token prefill, the graph's own ``ffn_gate-N``,
``ffn_up-N`` and ``ffn_geglu-N`` tensors; float64 recomputes the product from the same gate and up
(so nothing upstream matters): from the float32 gate, from the gate rounded to float16, and through a
float16 table (float16 in, float16 out).
"""

from __future__ import annotations

import argparse
import re

import numpy as np

from ropekv.adapters.llamacpp import LlamaCppEngine, ggml
from ropekv.adapters.llamacpp.f32_gguf import default_f32_gguf
from ropekv.adapters.llamacpp.tap import GraphTap
from ropekv.models.default import default_gguf_path
from ropekv.parity.cases import token_stream

GGUF = default_gguf_path("gemma3-270m")  # Gemma 3 270M, the original Q4_K_M file
_FFN = re.compile(r"^(ffn_gate|ffn_up|ffn_geglu)-(\d+)$")


class FfnTap(GraphTap):
    """Records the MLP's gate, up and GEGLU output per layer, besides what GraphTap tracks."""

    def __init__(self, lib, num_layers: int):
        super().__init__(lib, num_layers)
        self.ffn: dict[tuple[str, int], np.ndarray] = {}

    def _handle(self, t, ask: bool) -> bool:
        m = _FFN.match(ggml.name_of(t))
        if m is not None and self.recording:
            if not ask:
                self.ffn[(m.group(1), int(m.group(2)))] = ggml.read(t, 2).astype(np.float64)
            return True
        return super()._handle(t, ask)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def gelu_table(x: np.ndarray) -> np.ndarray:
    """A float16 GELU table as ggml's CPU backend keeps one: the float16 gate in, a float16 value out
    (beyond +-10 the gate itself, or 0)."""
    looked_up = gelu_tanh(x.astype(np.float16).astype(np.float64)).astype(np.float16).astype(np.float64)
    return np.where(x > 10.0, x, np.where(x < -10.0, 0.0, looked_up))


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(1.0, np.abs(b).max()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=str(GGUF))
    args = ap.parse_args()
    eng = LlamaCppEngine(default_f32_gguf(args.gguf), tier="logits")
    tap = FfnTap(eng._lib, eng.config.num_layers)
    ctx = eng.context(64, tap)
    tokens = token_stream(eng.config.vocab_size, 64, seed=0).tolist()
    tap.start()
    ctx.prefill(tokens, 0)
    tap.stop()
    print(
        f"{'layer':>5} {'max|gate|':>9} {'llama.cpp vs f64(gate f32)':>27} {'vs f64(gate rounded to f16)':>28} {'vs f16 table lookup':>22}"
    )
    worst32, worst16, worst_tab = 0.0, 0.0, 0.0
    for layer in range(eng.config.num_layers):
        gate, up, out = (tap.ffn[(k, layer)] for k in ("ffn_gate", "ffn_up", "ffn_geglu"))
        exact = gelu_tanh(gate) * up
        via_f16 = gelu_tanh(gate.astype(np.float16).astype(np.float64)) * up
        table = gelu_table(gate) * up
        e32, e16, etab = rel(out, exact), rel(out, via_f16), rel(out, table)
        worst32, worst16, worst_tab = max(worst32, e32), max(worst16, e16), max(worst_tab, etab)
        print(f"{layer:>5} {np.abs(gate).max():9.2f} {e32:27.2e} {e16:28.2e} {etab:22.2e}")
    print(
        f"worst: {worst32:.2e} against float32 gates, {worst16:.2e} against float16-rounded gates, "
        f"{worst_tab:.2e} against a float16 table (float16 in, float16 out)"
    )


if __name__ == "__main__":
    main()
