"""Finding: mlx-lm's load_prompt_cache loads a prompt cache into a model with another RoPE or window.

A writer (the embedded SmolLM2, or the same weights with every odd layer sliding, window 24) prefills
40 tokens and saves its prompt cache; readers built by mlx-lm from the same weights under another
configuration (``load_model(path, model_config=...)``) load the file with mlx-lm's own
``load_prompt_cache`` and decode 3 tokens. The file records no RoPE, model or window, so every load
succeeds; the decode is compared with the reader's own uncached forward (what it computes without
the file) and with the writer's. Then ropekv's ``load_checked`` on the same file and reader.

Run from .venv-mlx:  .venv-mlx/bin/python scripts/findings/mlx_prompt_cache_transfer.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from ropekv.adapters.mlx.runtime import import_mlx

RT = import_mlx("openblas")  # OpenBLAS under mlx before anything imports mlx.core

from ropekv.adapters.mlx.cache_contract import model_fingerprint  # noqa: E402
from ropekv.adapters.mlx.engine import model_directory  # noqa: E402
from ropekv.adapters.mlx.prompt_cache import load_checked, save_checked  # noqa: E402
from ropekv.errors import ContractMismatch  # noqa: E402
from ropekv.parity.cases import token_stream  # noqa: E402

mx, cache = RT.mx, RT.cache
LENGTH, STEPS = 40, 3
SLIDING = ["sliding_attention" if i % 2 else "full_attention" for i in range(30)]
CASES = [
    ("same model", {}, {}),
    ("rope_theta 100000 -> 20000", {}, {"rope_theta": 20000.0}),
    ("rope_scaling none -> linear x2", {}, {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    ("rope_scaling none -> dynamic x2", {}, {"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
    ("sliding window 24 -> 16", {"layer_types": SLIDING, "sliding_window": 24}, {"sliding_window": 16}),
    ("sliding window 24 -> 32", {"layer_types": SLIDING, "sliding_window": 24}, {"sliding_window": 32}),
]


def logits(model, tokens: torch.Tensor, caches) -> torch.Tensor:
    x = mx.array(tokens.numpy().astype(np.int32))[None]
    y = model(x, cache=caches)[0].astype(mx.float32)
    mx.eval(y)
    return torch.from_numpy(np.array(y))


def uncached(model, tokens: torch.Tensor) -> torch.Tensor:
    return logits(model, tokens, [cache.ConcatenateKVCache() for _ in model.layers])


def main() -> None:
    path = model_directory(None)
    tokens = token_stream(49152, LENGTH + STEPS)
    print(f"mlx-lm {RT.versions['mlx-lm']}, mlx {RT.versions['mlx']}; prompt {LENGTH} tokens, {STEPS} decode steps")
    print(
        f"{'writer -> reader':<34} {'raw load':<9} {'max|dlogit| vs reader uncached':>31} {'vs writer uncached':>19}  ropekv load_checked"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for label, w_over, r_over in CASES:
            writer, _ = RT.utils.load_model(path, model_config=dict(w_over))
            reader, _ = RT.utils.load_model(path, model_config={**w_over, **r_over})
            fp = model_fingerprint(writer)
            caches = cache.make_prompt_cache(writer)
            logits(writer, tokens[:LENGTH], caches)
            file = Path(tmp) / "prompt.safetensors"
            save_checked(file, caches, writer, fingerprint=fp)
            raw = cache.load_prompt_cache(str(file))  # mlx-lm's own loader: no check to fail
            kinds = sorted({type(c).__name__ + (f"({c.max_size})" if hasattr(c, "max_size") else "") for c in raw})
            got = torch.stack([logits(reader, tokens[t : t + 1], raw)[-1] for t in range(LENGTH, LENGTH + STEPS)])
            own = uncached(reader, tokens)[LENGTH:]
            theirs = uncached(writer, tokens)[LENGTH:]
            vs_own = [float((g - o).abs().max()) for g, o in zip(got, own)]
            vs_writer = [float((g - o).abs().max()) for g, o in zip(got, theirs)]
            try:
                load_checked(file, reader, fingerprint=fp)
                verdict = "accepted"
            except ContractMismatch as exc:
                verdict = f"refused, exit {exc.exit_code}: {', '.join(exc.fields[:2])}" + (
                    f" (+{len(exc.fields) - 2} per-layer)" if len(exc.fields) > 2 else ""
                )
            span = lambda v: f"{min(v):.3g}-{max(v):.3g}"
            print(f"{label:<34} {'loaded':<9} {span(vs_own):>31} {span(vs_writer):>19}  {verdict}")
            print(f"{'':<34} caches from the file: {', '.join(kinds)}")


if __name__ == "__main__":
    main()
