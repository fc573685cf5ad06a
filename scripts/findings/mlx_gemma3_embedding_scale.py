"""Finding: mlx-lm's gemma3_text scales the token embeddings by sqrt(hidden_size) rounded to bfloat16,
in every dtype: 25.25 for Gemma 3 270M (hidden 640) where transformers (and ropekv's reading of the
config) use sqrt(640) = 25.2982, x0.998094.

``Gemma3Model.__call__``: ``h *= mx.array(self.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)``.
A float32 run therefore computes another model than transformers' float32 one. Layer 0's keys and
queries do not see it (``input_layernorm`` is an RMSNorm: a constant factor cancels); the residual
add ``h + post_attention_layernorm(attn)`` weighs the scaled embedding against the attention output,
so later layers' inputs differ by 0.06-0.2% and the logits by 0.13 max abs (0.0038 scale-aware,
ropekv's float32 tolerance is 0.002) on a 600-token prompt, 1.28 on one row of a 40-token prompt.
RoPE and the caches are not involved: mlx-lm's cached decode equals its own uncached forward either
way (3.8e-05), and with the factor set to 25.25 ropekv's float64 reference agrees with mlx-lm to
1e-4 in the logits and 1e-5 in every key.

What this script does not verify: it does not run transformers (ropekv's float64 reference stands for
it; ropekv's ``--engine hf`` check on the same folder passes, run by the main session); transformers'
``Gemma3TextScaledWordEmbedding`` was read: ``embed_scale=hidden_size**0.5`` cast to the weights' dtype.

Run from .venv-mlx:  .venv-mlx/bin/python scripts/findings/mlx_gemma3_embedding_scale.py [FOLDER]
(FOLDER: a Gemma 3 transformers folder in float32, default: the embedded gemma3-270m converted folder)
"""

from __future__ import annotations

import sys

import torch

from ropekv.adapters.mlx.runtime import import_mlx

RT = import_mlx("openblas")  # before anything imports mlx.core

from ropekv.adapters.mlx import MLXEngine  # noqa: E402
from ropekv.models.config import Checkpoint  # noqa: E402
from ropekv.models.default import default_checkpoint_dir  # noqa: E402
from ropekv.models.reference import ReferenceDecoder  # noqa: E402
from ropekv.parity.cases import Case, token_stream  # noqa: E402
from ropekv.parity.compare import scaled_error  # noqa: E402

FOLDER = sys.argv[1] if len(sys.argv) > 1 else str(default_checkpoint_dir("gemma3-270m"))
L = 600
ROWS = [0, 511, 512, L - 1]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def main() -> None:
    engine = MLXEngine(FOLDER)
    mx = RT.mx
    file_cfg, cfg = engine.file_config, engine.config
    bf16 = float(mx.array(file_cfg.hidden_size**0.5, mx.bfloat16).astype(mx.float32))
    print(
        f"config.json: sqrt({file_cfg.hidden_size}) = {file_cfg.embedding_scale:.7g}; "
        f"mlx.array(sqrt, bfloat16) = {bf16:.7g}; measured on mlx-lm's forward: {cfg.embedding_scale:.7g}"
    )
    ck = engine.checkpoint
    refs = {
        "transformers' factor": ReferenceDecoder(Checkpoint(file_cfg, ck.weights, ck.source, ck.fingerprint)),
        "mlx-lm's factor": ReferenceDecoder(ck),
    }
    tokens = token_stream(cfg.vocab_size, L + 4)
    full = engine.full_forward(tokens[:L], ROWS, Case(length=L))  # mlx-lm, no cache
    case = Case(length=L, decode_steps=1)
    cached = engine.run_case(case, tokens).steps[0]  # mlx-lm, make_prompt_cache, decode at 600
    for name, ref in refs.items():
        out = ref.forward(tokens[:L], probe_rows=ROWS)
        dec = ref.forward(tokens[: L + 1], probe_rows=[L])
        print(f"\nfloat64 reference with {name}:")
        print(
            f"  mlx-lm uncached forward, rows {ROWS}: max|dlogit| {float((full.logits.double() - out.logits[ROWS]).abs().max()):.3g}, "
            f"scale-aware {max(scaled_error(full.logits[i], out.logits[r]) for i, r in enumerate(ROWS)):.3g}"
        )
        print(
            f"  mlx-lm cached decode at {L}: max|dlogit| {float((cached.logits.double() - dec.logits[L]).abs().max()):.3g}"
        )
        for li in (0, 1, 5, 17):
            m, r = full.layers[li], out.layers[li]
            keys = rel(m.k, r.k)  # every key 0..L-1, after k_norm and RoPE
            print(
                f"  layer {li:2d} ({cfg.layer_attention(li).kind:7s}): input rel err {rel(m.hidden_in, r.hidden_in):.3g}, "
                f"keys rel err {keys:.3g}, queries rel err {rel(m.q, r.q):.3g}"
            )
    self_err = float(
        (cached.logits - engine.full_forward(tokens[: L + 1], [L], Case(length=L + 1)).logits[0]).abs().max()
    )
    print(f"\nmlx-lm cached decode at {L} vs its own uncached forward: max|dlogit| {self_err:.3g}")


if __name__ == "__main__":
    main()
